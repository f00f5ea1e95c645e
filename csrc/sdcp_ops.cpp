// The `sdcp` operator library: the schemas every device's implementation registers against
// (cpu/verify_cpu.cpp for CPU tensors). Python reaches them as torch.ops.sdcp.<name>, through
// kernels/native.py, which documents the tensors; a CUDA implementation would live in
// csrc/cuda/ and register the same schemas with TORCH_LIBRARY_IMPL(sdcp, CUDA, m).
#include <torch/library.h>

namespace sdcp {

// Bumped whenever a schema or its meaning changes: kernels/native.py refuses a stale build.
constexpr int64_t kNativeVersion = 6;

}  // namespace sdcp

TORCH_LIBRARY(sdcp, m) {
  m.def(
      "verify(Tensor logits, Tensor draft_tokens, Tensor num_draft, Tensor rule, "
      "Tensor temperature_milli, Tensor top_k, Tensor top_p_milli, Tensor? q, Tensor q_start, "
      "Tensor accept_uniforms, Tensor extra_uniforms, Tensor row_start, Tensor token_start) "
      "-> (Tensor accepted, Tensor extra_token, Tensor bad_q, Tensor nan_logits)");
  // verify on the two buffers kernels/batch.py's PackedBatch packs the batch into (layout
  // there), answering one [4, B] int64 tensor: accepted, extra_token, bad_q, nan_logits
  m.def(
      "verify_packed(Tensor logits, Tensor ints, Tensor floats, Tensor? q, int num_proposals) "
      "-> Tensor");
  m.def(
      "target_probs(Tensor logits, Tensor temperature_milli, Tensor top_k, Tensor top_p_milli) "
      "-> Tensor");
  m.def("native_version() -> int", []() -> int64_t { return sdcp::kNativeVersion; });
  // the OpenMP version the op was compiled with (0: none, and every cpu/parallel.h split in it
  // runs serially in the calling thread whatever torch's thread count)
  m.def("openmp() -> int", []() -> int64_t {
#ifdef _OPENMP
    return _OPENMP;
#else
    return 0;
#endif
  });
}
