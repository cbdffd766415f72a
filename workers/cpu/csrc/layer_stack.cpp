// layer_stack: every decoder layer of a Llama-style model, one C++ call per step (CPU, one rank).
//
// Why: the Python layer loop dispatches ~12 ops and ~6 module calls per layer. On a 2-core AMD
// EPYC (Zen 1) a batch-1 decode step of the default model took 45-49 ms of which the ops were
// ~34 ms: ~28% of the step thread's samples (perf) were the interpreter and torch's Python
// bindings between ops, while torch's second OpenMP thread spun at its barrier. This is the CPU's
// counterpart of replaying a CUDA graph: the same ops, in the same order, on the same tensors,
// called through the dispatcher from C++ (results are bit-identical to the Python path: the
// tests compare them), so only the interpreter's share of the step goes away.
//
// What it runs per layer (workers/model/layers.py's forward_fused_residual, DecoderAttention,
// GatedMLP with SiLU, and attention.paged_attention's kernel path):
//   residual, h = add_rms_norm(residual, x)        (layer 0: residual = x, h = rms_norm(x))
//   q, k, v     = split(linear(h, qkv))            rotary_(q, k); reshape_and_cache(k, v)
//   out         = paged_decode_attention(decodes) + paged_prefill_attention(prefill chunks)
//                 (or, with prefill_sdpa, SDPA per chunk as the Python loop runs it)
//   residual, h = add_rms_norm(residual, linear(out, o))
//   x           = linear(silu_and_mul(linear(h, gate_up)), down)
// and returns (x, residual) of the last layer; the model's final norm adds them.
// A linear takes its small-batch kernel up to small_batch_rows rows (amx_linear on an AMX tile
// copy, panel_linear on a panel copy, skinny_linear on the plain bf16 weight), oneDNN's
// prepacked GEMM (mkldnn::_linear_pointwise) above when a packed weight is given, else
// at::linear: workers/cpu/linear.py's linear(), decided the same way.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <string_view>

namespace {

// Tensors per projection, in this order: the plain weight, oneDNN's packed one, the small-batch
// kernel's (cpu_linear.py's small_batch_weight), the bias; any but one of the first three may be
// None (a small-batch kernel that takes every batch leaves no packed one).
enum LinearSlot : int64_t { kWeight, kPacked, kSmall, kBias, kSlotsPerLinear };

// Tensors per layer in the flat weight list, in this order (workers/model/cpu_layer_stack.py builds it):
// the input norm, the QKV projection's four, the O projection's, the post-attention norm, then the
// gate-up and down projections'.
enum LayerSlot : int64_t {
  kInputNorm = 0,
  kQkv = 1,
  kO = kQkv + kSlotsPerLinear,
  kPostNorm = kO + kSlotsPerLinear,
  kGateUp = kPostNorm + 1,
  kDown = kGateUp + kSlotsPerLinear,
  kSlotsPerLayer = kDown + kSlotsPerLinear,
};

using OptTensor = std::optional<at::Tensor>;

// The ops this file composes, looked up once (typed: the dispatcher checks each signature).
struct Ops {
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, double, double)> rms_norm;
  c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                              double, double)>
      add_rms_norm;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&)> silu_and_mul;
  c10::TypedOperatorHandle<void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&)>
      rotary;
  c10::TypedOperatorHandle<void(const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor, const at::Tensor&)>
      reshape_and_cache;
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, double, int64_t, double)>
      decode_attention;
  c10::TypedOperatorHandle<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                const at::Tensor&, const at::Tensor&, double, int64_t, double)>
      prefill_attention;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)> skinny_linear;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)> panel_linear;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)> amx_linear;
  c10::TypedOperatorHandle<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, std::string_view,
                                      c10::List<std::optional<at::Scalar>>, std::optional<std::string_view>)>
      packed_linear;

  static const Ops& get() {
    static const Ops ops = [] {
      auto find = [](const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); };
      return Ops{
          find("tpserve_cpu::rms_norm").typed<at::Tensor(const at::Tensor&, const at::Tensor&, double, double)>(),
          find("tpserve_cpu::add_rms_norm")
              .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                        double, double)>(),
          find("tpserve_cpu::silu_and_mul").typed<at::Tensor(const at::Tensor&)>(),
          find("tpserve_cpu::rotary_")
              .typed<void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&)>(),
          find("tpserve_cpu::reshape_and_cache")
              .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor, const at::Tensor&)>(),
          find("tpserve_cpu::paged_decode_attention")
              .typed<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, double, int64_t, double)>(),
          find("tpserve_cpu::paged_prefill_attention")
              .typed<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, double, int64_t, double)>(),
          find("tpserve_cpu::skinny_linear")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>(),
          find("tpserve_cpu::panel_linear").typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>(),
          find("tpserve_cpu::amx_linear").typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&)>(),
          find("mkldnn::_linear_pointwise")
              .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, std::string_view,
                                c10::List<std::optional<at::Scalar>>, std::optional<std::string_view>)>(),
      };
    }();
    return ops;
  }
};

// The one choice of small-batch projection kernel, by the layout workers/cpu/linear.py packed the
// weight in: AMX tile order is 4-D ([N/16, K/32, 16, 32], amx_linear), panels 3-D ([N/16, K, 16], or
// bf16 k-pairs [N/16, K/2, 32]: panel_linear), a plain bf16 weight 2-D (skinny_linear). x is [M, K]. Python's
// linear() calls it through the small_batch_linear op, the layer stack directly.
at::Tensor small_batch_linear_with(const Ops& ops, const at::Tensor& x, const at::Tensor& small, const OptTensor& bias) {
  if (small.dim() == 4) return ops.amx_linear.call(x, small, bias);
  if (small.dim() == 3) return ops.panel_linear.call(x, small, bias);
  return ops.skinny_linear.call(x, small, bias);
}

at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& small, const OptTensor& bias) {
  return small_batch_linear_with(Ops::get(), x, small, bias);
}

// workers/cpu/linear.py's linear(): the small-batch kernel up to small_rows rows (a limit of 0:
// never), the packed GEMM when there is a packed weight, at::linear on the plain weight
// otherwise. `w` yields the projection's slots.
template <typename Slot>
at::Tensor project(const Ops& ops, const at::Tensor& x, Slot&& w, int64_t small_rows) {
  const OptTensor &packed = w(kPacked), &small = w(kSmall), &bias = w(kBias);
  if (small.has_value() && x.size(0) <= small_rows) return small_batch_linear_with(ops, x, *small, bias);
  if (packed.has_value()) return ops.packed_linear.call(x, *packed, bias, "none", c10::List<std::optional<at::Scalar>>(), std::nullopt);
  const OptTensor& weight = w(kWeight);
  TORCH_CHECK(weight.has_value(), "layer_stack: a projection has neither a plain nor a packed weight");
  return at::linear(x, *weight, bias);
}

// Query and key rows of a bf16/fp16 SDPA call are padded to a multiple of this, for the reason
// and with the numbers attention.py's SDPA_ROW_ALIGN gives; the padding is built the same way
// there, so both paths keep calling SDPA on identical tensors.
constexpr int64_t kSdpaRowAlign = 32;

int64_t sdpa_rows(int64_t rows, bool pad) {
  return pad ? (rows + kSdpaRowAlign - 1) / kSdpaRowAlign * kSdpaRowAlign : rows;
}

// [n, heads, D] rows -> [1, heads, rows, D], zero rows appended (attention.py's _sdpa_layout).
at::Tensor sdpa_layout(const at::Tensor& x, int64_t rows) {
  const at::Tensor padded = rows == x.size(0) ? x : at::constant_pad_nd(x, {0, 0, 0, 0, 0, rows - x.size(0)});
  return padded.transpose(0, 1).unsqueeze(0);
}

// attention.paged_attention's SDPA loop over a step's prefill chunks, op for op (the path where
// the prefill kernel is not chosen: bf16 on builds without its AMX tiles, where torch's flash
// attention measured faster, see workers/attention/paged.py prefill_kernel_serves; or the kernel
// switched off by config; the choice arrives as prefill_sdpa). A chunk at position 0 with no window inside
// it attends to its own K/V, causal; any other gathers its context through its block table and
// masks it (causal from its offset, and the window). Padded keys come after the context and
// padded queries after the chunk (in the masked form each takes the last real query's position),
// so no real query sees a padded key: its result is the unpadded call's up to rounding.
void sdpa_prefill(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_tables,
                  const at::Tensor& chunk_info, double scale, int64_t window) {
  const auto info = chunk_info.accessor<int32_t, 2>();
  const int64_t block_size = k_cache.size(1), kv_heads = k_cache.size(2), head_dim = k_cache.size(3);
  const bool gqa = q.size(1) != k.size(1);
  const bool pad = q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf;
  for (int64_t c = 0; c < chunk_info.size(0); ++c) {
    const int64_t s = info[c][0], n = info[c][1], context = info[c][2];
    const int64_t rows = sdpa_rows(n, pad);
    const at::Tensor qp = sdpa_layout(q.narrow(0, s, n), rows);
    const bool windowed = window > 0 && window < context;
    at::Tensor op;
    if (context == n && !windowed) {
      op = at::scaled_dot_product_attention(qp, sdpa_layout(k.narrow(0, s, n), rows),
                                            sdpa_layout(v.narrow(0, s, n), rows), std::nullopt, 0.0,
                                            /*is_causal=*/true, scale, gqa);
    } else {
      const int64_t blocks = (context + block_size - 1) / block_size;
      const int64_t keys_len = sdpa_rows(context, pad);
      const at::Tensor table = block_tables[c].narrow(0, 0, blocks).to(at::kLong);
      auto gather = [&](const at::Tensor& cache) {
        const at::Tensor context_rows =
            cache.index_select(0, table).reshape({blocks * block_size, kv_heads, head_dim}).narrow(0, 0, context);
        return sdpa_layout(context_rows, keys_len);
      };
      const auto idx = at::TensorOptions().dtype(at::kLong);
      const at::Tensor keys = at::arange(keys_len, idx).unsqueeze(0);
      // A padded query row takes the last real row's position: its mask is never empty.
      const at::Tensor p = at::arange(context - n, context - n + rows, idx).clamp_max(context - 1).unsqueeze(1);
      at::Tensor mask = keys <= p;
      if (windowed) mask = mask & (keys > p - window);
      op = at::scaled_dot_product_attention(qp, gather(k_cache), gather(v_cache), mask, 0.0, /*is_causal=*/false,
                                            scale, gqa);
    }
    out.narrow(0, s, n).copy_(op[0].narrow(1, 0, n).transpose(0, 1));
  }
}

// What a model's layer stack keeps from load to unload: the weights, the KV caches and the shape
// constants. Built once (workers/model/cpu_layer_stack.py, again only when the runner's caches
// change) and handed to every step as one object. Why: passed as arguments, the ~17 tensors a layer
// (510 for the default model) were converted from Python objects on every step, each conversion
// touching the tensor's Python object and its TensorImpl, both evicted from the caches by the
// step's weight stream: ~0.1-0.17 ms of a 1-request step's ~9.5 (2-core Zen 4, docs/cpu-kernels.md).
// The caches are written by every step (reshape_and_cache): the object holds the tensors, not copies.
struct LayerStack : torch::CustomClassHolder {
  std::vector<OptTensor> weights;    // kSlotsPerLayer slots per layer (LayerSlot, LinearSlot)
  std::vector<at::Tensor> k_caches;  // per layer, [num_blocks, block_size, kv_heads, head_dim]
  std::vector<at::Tensor> v_caches;  // per layer, as k_caches
  at::Tensor cos, sin;               // the rotary table every layer shares
  std::vector<int64_t> windows;      // per layer, its sliding window (0: none)
  int64_t num_heads, num_kv_heads, head_dim;  // query heads, KV heads, and their width
  double eps, norm_offset;           // the RMS norms' epsilon and weight offset (Gemma's 1, else 0)
  double scale, soft_cap;            // the softmax scale and the logit soft cap (0: none)
  int64_t small_batch_rows;          // rows up to which a projection takes its small-batch kernel

  LayerStack(c10::List<std::optional<at::Tensor>> weight_slots, std::vector<at::Tensor> k, std::vector<at::Tensor> v,
             at::Tensor cos_table, at::Tensor sin_table, std::vector<int64_t> sliding_windows, int64_t heads,
             int64_t kv_heads, int64_t dim, double norm_eps, double offset, double softmax_scale, double cap,
             int64_t small_rows)
      : k_caches(std::move(k)), v_caches(std::move(v)), cos(std::move(cos_table)), sin(std::move(sin_table)),
        windows(std::move(sliding_windows)), num_heads(heads), num_kv_heads(kv_heads), head_dim(dim), eps(norm_eps),
        norm_offset(offset), scale(softmax_scale), soft_cap(cap), small_batch_rows(small_rows) {
    const int64_t layers = static_cast<int64_t>(k_caches.size());
    TORCH_CHECK(layers > 0 && static_cast<int64_t>(v_caches.size()) == layers &&
                    static_cast<int64_t>(windows.size()) == layers &&
                    static_cast<int64_t>(weight_slots.size()) == layers * kSlotsPerLayer,
                "layer_stack: ", layers, " layers need as many caches and windows and ", kSlotsPerLayer,
                " weight slots each");
    weights.reserve(weight_slots.size());
    for (const auto& w : weight_slots) weights.push_back(w);
    for (int64_t layer = 0; layer < layers; ++layer)
      for (const LayerSlot s : {kInputNorm, kPostNorm})
        TORCH_CHECK(weights[layer * kSlotsPerLayer + s].has_value(), "layer_stack: layer ", layer,
                    " lacks weight slot ", static_cast<int64_t>(s));
  }

  int64_t layers() const { return static_cast<int64_t>(k_caches.size()); }
  const OptTensor& slot(int64_t layer, int64_t s) const { return weights[layer * kSlotsPerLayer + s]; }
};

std::tuple<at::Tensor, at::Tensor> layer_stack(
    const c10::intrusive_ptr<LayerStack>& stack, const at::Tensor& x_in, const at::Tensor& positions,
    const at::Tensor& slot_mapping, const std::optional<at::Tensor>& decode_block_tables,
    const std::optional<at::Tensor>& decode_context_lens, const std::optional<at::Tensor>& prefill_block_tables,
    const std::optional<at::Tensor>& prefill_chunks, int64_t num_decodes, bool prefill_sdpa) {
  const LayerStack& st = *stack;
  TORCH_CHECK(x_in.dim() == 2 && positions.numel() == x_in.size(0), "layer_stack: x [T, hidden], positions [T]");
  const int64_t tokens = x_in.size(0);
  TORCH_CHECK(num_decodes >= 0 && num_decodes <= tokens, "layer_stack: more decodes than tokens");
  TORCH_CHECK(num_decodes == 0 || (decode_block_tables.has_value() && decode_context_lens.has_value()),
              "layer_stack: decodes need their block tables and context lengths");
  const bool chunks = num_decodes < tokens;
  TORCH_CHECK(!chunks || (prefill_block_tables.has_value() && prefill_chunks.has_value()),
              "layer_stack: prefill tokens need the prefill kernel's chunk table");
  TORCH_CHECK(!(chunks && prefill_sdpa && st.soft_cap != 0.0),
              "layer_stack: a soft cap needs the eager attention the Python loop runs (SDPA has no hook for it)");
  const Ops& ops = Ops::get();
  const int64_t num_heads = st.num_heads, num_kv_heads = st.num_kv_heads, head_dim = st.head_dim;
  const double eps = st.eps, norm_offset = st.norm_offset, scale = st.scale, soft_cap = st.soft_cap;
  const int64_t small_batch_rows = st.small_batch_rows;
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  // The slots of the projection whose first slot is `first`, one LinearSlot at a time.
  auto linear = [&st](int64_t layer, LayerSlot first) {
    return [&st, layer, first](LinearSlot s) -> const OptTensor& { return st.slot(layer, first + s); };
  };

  at::Tensor x = x_in, residual, h;
  for (int64_t layer = 0; layer < st.layers(); ++layer) {
    const at::Tensor& input_norm = *st.slot(layer, kInputNorm);
    if (layer == 0) {
      residual = x;
      h = ops.rms_norm.call(x, input_norm, eps, norm_offset);
    } else {
      std::tie(residual, h) = ops.add_rms_norm.call(residual, x, input_norm, eps, norm_offset);
    }
    const at::Tensor qkv = project(ops, h, linear(layer, kQkv), small_batch_rows);
    TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "layer_stack: the QKV projection's width does not fit the heads");
    const at::Tensor q = qkv.narrow(1, 0, q_size).view({tokens, num_heads, head_dim});
    const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({tokens, num_kv_heads, head_dim});
    const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, head_dim});
    ops.rotary.call(q, k, positions, st.cos, st.sin);
    const at::Tensor& k_cache = st.k_caches[layer];
    const at::Tensor& v_cache = st.v_caches[layer];
    ops.reshape_and_cache.call(k, v, k_cache, v_cache, slot_mapping);
    at::Tensor out = at::empty({tokens, num_heads, head_dim}, q.options());
    if (num_decodes > 0)
      ops.decode_attention.call(out.narrow(0, 0, num_decodes), q.narrow(0, 0, num_decodes), k_cache, v_cache,
                                *decode_block_tables, *decode_context_lens, scale, st.windows[layer], soft_cap);
    if (chunks && prefill_sdpa)
      sdpa_prefill(out, q, k, v, k_cache, v_cache, *prefill_block_tables, *prefill_chunks, scale, st.windows[layer]);
    else if (chunks)
      ops.prefill_attention.call(out, q, k_cache, v_cache, *prefill_block_tables, *prefill_chunks, scale,
                                 st.windows[layer], soft_cap);
    const at::Tensor attn = project(ops, out.view({tokens, q_size}), linear(layer, kO), small_batch_rows);
    std::tie(residual, h) = ops.add_rms_norm.call(residual, attn, *st.slot(layer, kPostNorm), eps, norm_offset);
    const at::Tensor gate_up = project(ops, h, linear(layer, kGateUp), small_batch_rows);
    x = project(ops, ops.silu_and_mul.call(gate_up), linear(layer, kDown), small_batch_rows);
  }
  return {x, residual};
}

int64_t layer_stack_slots_per_layer() { return kSlotsPerLayer; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(tpserve_cpu, m) {
  m.class_<LayerStack>("LayerStack")
      .def(torch::init<c10::List<std::optional<at::Tensor>>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       at::Tensor, at::Tensor, std::vector<int64_t>, int64_t, int64_t, int64_t, double, double, double,
                       double, int64_t>());
  // The caches the stack holds are written in place (reshape_and_cache), unannotated here: the
  // op is called eagerly, never traced.
  m.def(
      "layer_stack(__torch__.torch.classes.tpserve_cpu.LayerStack stack, Tensor x, Tensor positions, "
      "Tensor slot_mapping, Tensor? decode_block_tables, Tensor? decode_context_lens, Tensor? prefill_block_tables, "
      "Tensor? prefill_chunks, int num_decodes, bool prefill_sdpa) -> (Tensor, Tensor)",
      &layer_stack);
  m.def("layer_stack_slots_per_layer() -> int", &layer_stack_slots_per_layer);
  m.def("small_batch_linear(Tensor x, Tensor small_batch_weight, Tensor? bias) -> Tensor", &small_batch_linear);
}
