"""How each choice a replica makes at load on this machine's own timings or probes is logged.

A kernel build, a panel form or a prefill-attention route is picked per process by timing the
alternatives where it starts, so two runs of one commit can serve with different kernels. Each
choice is logged once with a fixed opening, and `bench/online/serve_compare.py` collects the lines
that open so from a server's log into its results file: which choices served those figures. The
modules that log a choice and the benchmark that collects them both take the openings from here,
so a reworded message cannot drop out of the results unnoticed.
"""

from __future__ import annotations

# Which ISA build of the CPU kernels loaded (workers/cpu/kernels.py).
KERNEL_BUILD = "tpserve CPU kernels:"
# bf16 panels: k-pairs on vdpbf16ps against weights widened as they load, timed (workers/cpu/linear.py).
PANEL_FORM = "bf16 panels at"
# Which batch sizes panel_linear takes and which oneDNN keeps (workers/cpu/linear.py).
PANEL_ROWS = "panel_linear takes"
# The int8 greedy LM head kept, with its row limit, or declined and why (workers/model/).
GREEDY_HEAD = "greedy LM head"
# Why the C++ layer loop does not run this model (workers/model/decoder.py).
LAYER_STACK_OFF = "CPU layer stack off"
# bf16 prefill attention: tpserve's kernel or SDPA, timed (workers/attention/cpu_prefill_choice.py).
PREFILL_ATTENTION = "bf16 prefill attention through"

# Every opening above: a log message starting with one of these records a load-time choice.
OPENINGS = (KERNEL_BUILD, PANEL_FORM, PANEL_ROWS, GREEDY_HEAD, LAYER_STACK_OFF, PREFILL_ATTENTION)
