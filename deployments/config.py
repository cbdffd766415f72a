"""The one validated configuration object of a tpserve application.

Everything `serve run deployments.app:build_app key=value ...`, `serve_config.yaml`, the CLI and
the KubeRay manifest pass ends up here; a bad value fails at start with a message naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from scheduler.config import GPU_MAX_NUM_SEQS


class ConfigError(ValueError):
    """A bad application config, with a message that names the offending field(s)."""


# Requests a replica admits beyond what its engine can hold (max_num_seqs + max_waiting_requests):
# those being parsed and tokenized, those the engine is about to refuse with its own 503, and
# routes outside the engine (models, tokenize, metrics, timelines).
ONGOING_HEADROOM = 64


class TpserveConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    # Path to a local HF folder (a supported architecture, see workers/model/config.py, + safetensors);
    # None = embedded SmolLM2 default.
    model: str | None = None
    # Name clients use in the `model` field; defaults to the folder name of `model`.
    served_model_name: str | None = None
    # "auto": weights from the model folder's *.safetensors; "dummy": seeded random weights from
    # config.json alone (workers/model/dummy_weights.py), to serve and benchmark any architecture's
    # shapes without weight files (the tokenizer is still read from the folder).
    load_format: Literal["auto", "dummy"] = "auto"
    # Seed of the dummy weights.
    dummy_seed: int = Field(default=0, ge=0)
    # Weights/activation dtype: "auto" = bfloat16 on GPU and on CPUs with AVX512-BF16/AMX or with AVX2 +
    # FMA but no AVX-512 where tpserve's bf16 kernels load (workers/runtime.py resolve_dtype), else float32.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Longest prompt + output in tokens; None = the model's max_position_embeddings.
    max_model_len: int | None = Field(default=None, gt=0)
    # Tokens per KV block.
    block_size: int = Field(default=16, gt=0, le=256)
    # KV cache size on CPU, GiB per rank.
    kv_cache_memory_gib: float = Field(default=2.0, gt=0)
    # Fraction of GPU memory tpserve may use (weights + activations + KV) on GPU.
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    # Most requests running at once.
    max_num_seqs: int = Field(default=64, gt=0)
    # Most tokens one step takes (prefill chunks + decode tokens). 2048, vLLM's CPU server's
    # default: reached at 64 requests with the two fields below (fixed at 1024 before; 2048 gave
    # 3-15% more tok/s at 64 streams in-process on the 2-core Xeon, docs/performance.md).
    max_num_batched_tokens: int = Field(default=2048, gt=0)
    # The step budget grows with the load: this many tokens per request in the engine (running +
    # waiting), between min_num_batched_tokens and max_num_batched_tokens; 0 = always the max.
    # Few requests: small prefill chunks, an earlier first token for each prompt (a chunk's prompts
    # all wait for the whole step); many: large chunks, fewer passes over the running decodes
    # (scheduler/scheduler.py, Scheduler.step_token_budget). While nothing decodes, the first
    # prompt in line alone may take its remaining tokens whole, up to the max (_head_prompt_chunk).
    num_batched_tokens_per_request: int = Field(default=32, ge=0)
    # Floor of that budget (a step of fewer prefill tokens runs the GEMMs at a poor M); capped
    # by max_num_batched_tokens.
    min_num_batched_tokens: int = Field(default=512, gt=0)
    # A step that carries decodes may take at most this many times what its decodes alone would
    # (and at least min_step_time_target_ms): prefill chunks are cut to fit, using step times
    # predicted by a cost model the scheduler learns from the steps it ran
    # (scheduler/step_cost.py), so a decode never waits behind a large prompt chunk (p99
    # inter-token latency). 0 = off (only the token budget above). Closed loops of 16 and 64
    # streams on a 2-core EPYC: p99 ITL 300-324 -> 107-112 ms and 1,201-1,257 -> 338-370 ms at
    # 0.95-0.99x and 0.96x the tok/s (docs/architecture.md#the-scheduler).
    max_decode_slowdown: float = Field(default=5.0, ge=0)
    # Floor of that step time target in ms, so that a few fast decodes do not cut prompts into
    # slivers (each step re-reads every weight): 100 ms, the TPOT service level of the goodput
    # the benchmarks report, is the longest a stream then waits behind prefill.
    min_step_time_target_ms: float = Field(default=100.0, ge=0)
    # Automatic prefix caching.
    enable_prefix_caching: bool = True
    # Ranks per replica; 1 runs the model in the replica's own process.
    tensor_parallel_size: int = Field(default=1, gt=0)
    # Placement strategy of the replica's placement group.
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD"] = "STRICT_PACK"
    # Refuse at deploy time a placement group the cluster can never hold (else Serve waits forever);
    # turn off on clusters whose autoscaler adds nodes on demand.
    check_placement_fits: bool = True
    # What replicas (TP = 1) or TP workers ask Ray for: "gpu" a GPU each, "cpu" CPUs only, "auto"
    # GPUs if the cluster has any when the app is built. A cluster whose GPU nodes are added on
    # demand (KubeRay autoscaling) has none at that moment: set "gpu" there.
    accelerator: Literal["auto", "gpu", "cpu"] = "auto"
    # Requests allowed to wait in the engine before new ones get the engine's 503 + Retry-After
    # (docs/security.md "Backpressure"): 2 x max_num_seqs at the defaults, so a request that
    # gets in starts within about two generations' time instead of queueing without bound.
    max_waiting_requests: int = Field(default=128, gt=0)
    # Fixed replica count (ignored when autoscaling_config is set).
    num_replicas: int = Field(default=1, gt=0)
    # Ray Serve autoscaling config (min_replicas, max_replicas, target_ongoing_requests, ...).
    autoscaling_config: dict[str, Any] | None = None
    # Ray Serve's cap on concurrent requests per replica; None = max_num_seqs +
    # max_waiting_requests + ONGOING_HEADROOM (256 at the defaults). It must exceed
    # max_num_seqs + max_waiting_requests: Serve then lets in every request the engine could hold,
    # and the engine's own OpenAI 503 answers overload before Serve's queue fills (below that,
    # max_waiting_requests could never be reached). Always an int after validation.
    max_ongoing_requests: int | None = Field(default=None, gt=0)
    # ---- scale-out (issue 14; deployments/scale_out.py turns these into Serve options) ----
    # Most replicas Serve places on one Ray node (None = no limit); 1 spreads replicas over nodes.
    max_replicas_per_node: int | None = Field(default=None, gt=0)
    # "kv_aware": a thin ingress reads the prompt and routes to the replica most likely to hold
    # its prefix in KV cache (deployments/routing/); "serve_default": Serve's power-of-two router.
    request_router: Literal["serve_default", "kv_aware"] = "serve_default"
    # With autoscaling_config: "engine_load" scales on the engines' waiting queues and KV usage
    # (deployments/autoscaling.py); "ongoing_requests" is Serve's own policy.
    autoscaling_signal: Literal["ongoing_requests", "engine_load"] = "ongoing_requests"
    # Ray resources the routing ingress (kv_aware) asks for, e.g. {"head_node": 0.01} to keep it
    # beside the HTTP proxy on a node that is not scaled away; None = anywhere.
    routing_ingress_resources: dict[str, float] | None = None
    # Replicas of the routing ingress (kv_aware): every token of every engine passes through
    # one of them, so a busy deployment runs several (each on its own event loop and process).
    # Ignored when routing_ingress_autoscaling_config is set.
    routing_ingress_replicas: int = Field(default=1, gt=0)
    # Ray Serve autoscaling config of the routing ingress (min_replicas, max_replicas,
    # target_ongoing_requests, ...); None = a fixed routing_ingress_replicas.
    routing_ingress_autoscaling_config: dict[str, Any] | None = None
    # Attach per-request `metrics` to every response (clients may also ask per request).
    request_metrics: bool = False
    # How many finished requests keep their timeline for GET /v1/requests/{id}/timeline.
    timeline_capacity: int = Field(default=1000, ge=0)
    # OpenTelemetry traces (docs/tracing.md): the OTLP/HTTP endpoint each finished request's
    # spans go to ("http://otel-collector:4318/v1/traces"); None = tracing off, nothing of
    # OpenTelemetry loaded. Needs the 'tracing' extra.
    otlp_traces_endpoint: str | None = Field(default=None, pattern=r"^https?://\S+$")
    # The spans' service.name.
    trace_service_name: str = Field(default="tpserve", min_length=1)
    # Seconds between periodic stats log lines while there is work.
    log_stats_interval_s: float = Field(default=5.0, gt=0)
    # A step that takes longer than this fails the engine (dead or hung worker).
    step_timeout_s: float = Field(default=120.0, gt=0)
    # torch intra-op threads of a CPU rank; None = every core this process may use. (Ray sets
    # OMP_NUM_THREADS=1 in replicas, which would leave a CPU engine on one core.)
    cpu_threads: int | None = Field(default=None, gt=0)
    # CPU: prepack linear weights for oneDNN once after loading (about 1.5x faster projections,
    # bf16 bit-identical results; workers/cpu/linear.py). Off = plain F.linear.
    cpu_prepack_linear: bool = True
    # CPU: tpserve's own kernels (workers/cpu/kernels.py, built by `make install` / the image, one
    # library per instruction set, picked at start by cpuid) for the norms, rotary embedding, SiLU
    # gate, KV write, decode and prefill attention, projections and argmax. "auto": used where they
    # load, else torch ops with a warning; "on": the server refuses to start without them; "off":
    # torch ops. (true/false still read as auto/off.)
    cpu_kernels: Literal["auto", "on", "off"] = "auto"
    # CPU: projections run tpserve's own kernels on a copy of each weight laid out for them:
    # float32 batches panel_linear (for as many rows as it was timed faster than oneDNN at load;
    # on a Zen 3 EPYC every batch: 1.5-1.7x oneDNN's speed at 1-16 rows, 1.17x at 512-2048),
    # bf16 on CPUs with AMX amx_linear up to 64 rows (1.3-1.9x at 1-32 rows on a Xeon), bf16 with
    # AVX512-BF16 only panel_linear on bf16 panels for as many rows as it was timed faster (1.4-1.7x
    # oneDNN on a Xeon's avx512_bf16 build; on a Zen 4 its vdpbf16ps k-pair panels, every batch,
    # 1.1-1.7x oneDNN's speed), else skinny_linear up to 8 rows (workers/cpu/linear.py).
    # Off = oneDNN's packed GEMM only.
    cpu_small_batch_linear: bool = True
    # CPU: prefill chunks through the kernels' flash attention, which reads the paged KV cache in
    # place (float32 1.5-3x torch's SDPA at 200-1000-token prompts on a 2-core AMD EPYC; bf16 on
    # AMX, and on AVX512-BF16 where timed faster at load, 2.9-4.6x on a Zen 4;
    # workers/cpu/csrc/prefill_attention.cpp). Off = torch's SDPA per chunk.
    cpu_prefill_attention: bool = True
    # CPU, one rank, Llama-style layers: the decoder's layer loop runs as one call into the
    # kernels (workers/model/cpu_layer_stack.py): the same ops in the same order, without the interpreter
    # between them (~28% of a batch-1 decode step's thread on a 2-core AMD EPYC). Off = the
    # Python loop over the layers.
    cpu_layer_stack: bool = True
    # CPU kernels, one rank: a greedy batch of 1-2 rows (no logprobs, no logits processing)
    # takes its tokens from an int8 copy of the LM head (half its bytes) and an exact pass over
    # the few vocabulary rows that copy cannot rule out: the same tokens, ~10% fewer bytes read
    # per token for the default model (workers/model/greedy_lm_head.py). Off = the full head.
    # Costs the copy's memory (28 MB for the default model).
    cpu_greedy_lm_head: bool = True
    # Run decode eagerly on GPU instead of replaying CUDA graphs.
    enforce_eager: bool = False
    # "auto": sampling defaults from the model's generation_config.json (temperature, top_p,
    # top_k, min_p, repetition_penalty, max tokens) fill what a request leaves out, as vLLM does;
    # "ignore": the OpenAI defaults. EOS ids from that file apply either way.
    generation_config: Literal["auto", "ignore"] = "auto"
    # Largest decode batch captured in a CUDA graph (capped by max_num_seqs).
    max_cuda_graph_batch_size: int = Field(default=256, gt=0)
    # GPU, Triton decode attention: steps with prefill chunks of up to this many tokens (capped
    # by max_num_batched_tokens) replay CUDA graphs too, one row per token; 0 = only decode-only
    # steps are graphed (on an H200 such a step ran eagerly at ~17 ms, a graphed decode 2.6-5 ms).
    max_cuda_graph_tokens: int = Field(default=2048, ge=0)

    # ---- limits on one request (issue 12: a request's own input can only fail that request) ----
    # Largest request body in bytes; larger bodies get 413 before they are parsed.
    max_request_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    # Deepest JSON nesting a body may have (chat content parts need about 5).
    max_json_depth: int = Field(default=32, gt=2)
    # Most characters of one prompt (completions) or of all messages (chat), checked before tokenizing.
    max_prompt_chars: int = Field(default=1_000_000, gt=0)
    # Most prompts in one completions request.
    max_prompts_per_request: int = Field(default=64, gt=0)
    # Most of the waiting queue one request's choices (prompts x n) may take, as a fraction.
    max_waiting_share: float = Field(default=0.25, gt=0, le=1)
    # Most stop strings, characters per stop string, and stop token ids per request.
    max_stop_strings: int = Field(default=16, ge=0)
    max_stop_string_chars: int = Field(default=256, gt=0)
    max_stop_token_ids: int = Field(default=64, ge=0)
    # Threads that tokenize prompts and parse bodies off the event loop.
    tokenizer_threads: int = Field(default=2, gt=0)
    # Seconds between the background worker health pings /health reads.
    health_check_interval_s: float = Field(default=2.0, gt=0)
    # Most messages in one chat request (checked before the template renders them).
    max_messages_per_request: int = Field(default=1024, gt=0)

    # ---- structured output (response_format grammars, compiled by xgrammar) ----
    # Seconds one grammar may take to compile; a slower schema is a 400 naming response_format.
    grammar_compile_timeout_s: float = Field(default=10.0, gt=0)
    # Bytes of compiled grammars kept for reuse (xgrammar's cache); least recently used go first.
    grammar_cache_bytes: int = Field(default=256 * 1024 * 1024, gt=0)
    # Threads that compile grammars (their own pool, apart from the body-parsing threads).
    grammar_compile_threads: int = Field(default=1, gt=0)

    # ---- deadlines, backpressure and tenants ----
    # Default seconds a request may take end to end before it is aborted (its KV freed); a
    # request may ask for less with its own `request_timeout_s` field. None = no deadline.
    request_timeout_s: float | None = Field(default=None, gt=0)
    # Requests Ray Serve queues (per caller: each HTTP proxy, each routing-ingress replica) while
    # every replica is at max_ongoing_requests, before it refuses new ones with 503 +
    # Retry-After; bounded so that excess load is refused instead of waiting without limit.
    # 0 = refuse as soon as every replica is full.
    max_queued_requests: int = Field(default=64, ge=0)
    # HTTP header whose value (an API key, a tenant id) salts the prefix cache of the request, so
    # that requests of different tenants never share cached prefixes; None = one shared cache
    # (docs/security.md "Tenant isolation"). Matched case-insensitively.
    cache_salt_header: str | None = Field(default=None, min_length=1, max_length=128,
                                          pattern=r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")

    # ---- integrations (off by default) ----
    # KV-cache events in vLLM's schema over ZMQ, for prefix-aware routers (None = off). Keys:
    # endpoint (a ZMQ PUB address), topic, replay_endpoint (ZMQ ROUTER; None = no replay),
    # buffer_steps (how many step batches replay can serve).
    kv_events: dict[str, Any] | None = None

    @field_validator("cpu_kernels", mode="before")
    @classmethod
    def _cpu_kernels_from_bool(cls, value: Any) -> Any:
        # Configs written when this field was a boolean keep their meaning.
        return {True: "auto", False: "off"}.get(value, value) if isinstance(value, bool) else value

    @model_validator(mode="after")
    def _check_budgets(self) -> "TpserveConfig":
        if self.max_model_len is not None and self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least block_size")
        if 0 < self.max_decode_slowdown < 1:
            raise ValueError("max_decode_slowdown must be 0 (off) or at least 1 (a step cannot take less than its decodes)")
        return self

    @model_validator(mode="after")
    def _resolve_backpressure(self) -> "TpserveConfig":
        # A GPU replica left to size max_num_seqs itself runs up to GPU_MAX_NUM_SEQS (sized from
        # free memory inside the replica, after Serve's options are fixed): count that many.
        seqs = self.max_num_seqs
        if self.accelerator == "gpu" and "max_num_seqs" not in self.model_fields_set:
            seqs = max(seqs, GPU_MAX_NUM_SEQS)
        engine_room = seqs + self.max_waiting_requests
        if self.max_ongoing_requests is None:
            self.max_ongoing_requests = engine_room + ONGOING_HEADROOM
        elif self.max_ongoing_requests <= engine_room:
            raise ValueError(
                f"max_ongoing_requests ({self.max_ongoing_requests}) must exceed max_num_seqs + "
                f"max_waiting_requests ({self.max_num_seqs} + {self.max_waiting_requests} = {engine_room}): "
                "otherwise Serve queues the excess and the engine's 503 for a full max_waiting_requests "
                "never comes; raise max_ongoing_requests or leave it unset (derived)"
            )
        return self

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> "TpserveConfig":
        """Validate a plain dict (Serve app args, YAML, CLI); raise ConfigError naming the fields."""
        try:
            return cls.model_validate(dict(args or {}))
        except ValidationError as exc:
            problems = []
            for err in exc.errors():
                field_name = ".".join(str(p) for p in err["loc"]) or "config"
                problems.append(f"{field_name}: {err['msg']}")
            raise ConfigError("invalid tpserve config: " + "; ".join(problems)) from None
