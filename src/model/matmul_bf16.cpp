// ringflex model: bf16 x bf16 -> float32 matmuls through oneDNN, one thread per call.
#include "model/matmul_bf16.h"

#include <omp.h>
#include <oneapi/dnnl/dnnl.h>
#include <oneapi/dnnl/dnnl_debug.h>

#include <map>
#include <tuple>

#include "core/error.h"
#include "cpu/isa.h"

namespace rf::model {

namespace {

void check(dnnl_status_t status, const char* what) {
  RF_CHECK(status == dnnl_success, "oneDNN ", what, " failed: ", dnnl_status2str(status));
}

dnnl_engine_t cpu_engine() {
  // One engine for the process: a CPU engine holds no per-thread state, and primitives from it run on any thread.
  static dnnl_engine_t engine = [] {
    dnnl_engine_t e = nullptr;
    check(dnnl_engine_create(&e, dnnl_cpu, 0), "engine creation");
    return e;
  }();
  return engine;
}

// oneDNN (Debian's build uses the OpenMP runtime) sizes its plan by omp_get_max_threads() when a primitive is created
// and forks a team when one runs outside a parallel region. Inside model::gemm's own split each call must stay on its
// thread and plan for one thread, so that no reduction is cut across threads: the OpenMP thread count of this task is
// set to 1 for the call and put back after (nthreads-var is per task, so other threads are not affected).
class OneThreadForOneDnn {
 public:
  OneThreadForOneDnn() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~OneThreadForOneDnn() { omp_set_num_threads(saved_); }
  OneThreadForOneDnn(const OneThreadForOneDnn&) = delete;
  OneThreadForOneDnn& operator=(const OneThreadForOneDnn&) = delete;

 private:
  int saved_;
};

// A matmul's shape and scalars: what a primitive is specialised on.
using PrimitiveKey = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, float, DType>;

dnnl_data_type_t dnnl_type(DType t) { return t == DType::F32 ? dnnl_f32 : dnnl_bf16; }

// Creating a primitive descriptor walks oneDNN's implementation list (tens of microseconds); the model repeats a few
// dozen shapes every layer, so each thread keeps the primitives it made. Per thread, so no lock is taken per call.
struct ThreadPrimitives {
  std::map<PrimitiveKey, dnnl_primitive_t> primitives;
  dnnl_stream_t stream = nullptr;
  ThreadPrimitives() { check(dnnl_stream_create(&stream, cpu_engine(), dnnl_stream_default_flags), "stream creation"); }
  ~ThreadPrimitives() {
    for (auto& [key, p] : primitives) dnnl_primitive_destroy(p);
    dnnl_stream_destroy(stream);
  }
  ThreadPrimitives(const ThreadPrimitives&) = delete;
  ThreadPrimitives& operator=(const ThreadPrimitives&) = delete;
};

dnnl_memory_desc_t matrix_desc(int64_t rows, int64_t cols, bool transposed, dnnl_data_type_t type, int64_t ld) {
  // A [rows, cols] matrix stored row-major with leading dimension ld, or its transpose (stored [cols, rows]).
  dnnl_memory_desc_t md;
  const dnnl_dims_t dims = {rows, cols};
  const dnnl_dims_t strides = {transposed ? 1 : ld, transposed ? ld : 1};
  check(dnnl_memory_desc_init_by_strides(&md, 2, dims, type, strides), "memory descriptor");
  return md;
}

dnnl_primitive_t make_matmul(const PrimitiveKey& key) {
  const auto [trans_a, trans_b, m, n, k, lda, ldb, ldc, alpha, beta, c_dtype] = key;
  const dnnl_memory_desc_t a = matrix_desc(m, k, trans_a, dnnl_bf16, lda);
  const dnnl_memory_desc_t b = matrix_desc(k, n, trans_b, dnnl_bf16, ldb);
  const dnnl_memory_desc_t c = matrix_desc(m, n, false, dnnl_type(c_dtype), ldc);
  dnnl_matmul_desc_t desc;
  check(dnnl_matmul_desc_init(&desc, &a, &b, nullptr, &c), "matmul descriptor");
  dnnl_primitive_attr_t attr = nullptr;
  check(dnnl_primitive_attr_create(&attr), "attribute creation");
  if (alpha != 1.f) check(dnnl_primitive_attr_set_output_scales(attr, 1, 0, &alpha), "output scale");
  dnnl_post_ops_t post_ops = nullptr;
  if (beta != 0.f) {
    check(dnnl_post_ops_create(&post_ops), "post-op creation");
    check(dnnl_post_ops_append_sum(post_ops, beta), "sum post-op");
    check(dnnl_primitive_attr_set_post_ops(attr, post_ops), "post-op attribute");
  }
  dnnl_primitive_desc_t pd = nullptr;
  const dnnl_status_t created = dnnl_primitive_desc_create(&pd, &desc, attr, cpu_engine(), nullptr);
  if (post_ops) dnnl_post_ops_destroy(post_ops);
  dnnl_primitive_attr_destroy(attr);
  check(created, "bf16 matmul primitive descriptor");
  dnnl_primitive_t p = nullptr;
  const dnnl_status_t made = dnnl_primitive_create(&p, pd);
  dnnl_primitive_desc_destroy(pd);
  check(made, "bf16 matmul primitive");
  return p;
}

}  // namespace

void bf16_gemm_on_this_thread(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const bf16* A,
                              int64_t lda, const bf16* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  bf16_gemm_on_this_thread(trans_a, trans_b, m, n, k, alpha, A, lda, B, ldb, beta, C, DType::F32, ldc);
}

void bf16_gemm_on_this_thread(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const bf16* A,
                              int64_t lda, const bf16* B, int64_t ldb, float beta, void* C, DType c_dtype,
                              int64_t ldc) {
  RF_CHECK(m > 0 && n > 0 && k > 0, "bf16 gemm: empty shape [", m, ", ", n, ", ", k, "]");
  RF_CHECK(c_dtype == DType::F32 || beta == 0.f, "bf16 gemm: a bf16 C cannot be accumulated into (beta = ", beta, ")");
  OneThreadForOneDnn one_thread;
  thread_local ThreadPrimitives mine;
  const PrimitiveKey key{trans_a, trans_b, m, n, k, lda, ldb, ldc, alpha, beta, c_dtype};
  auto it = mine.primitives.find(key);
  if (it == mine.primitives.end()) it = mine.primitives.emplace(key, make_matmul(key)).first;

  const dnnl_memory_desc_t a_md = matrix_desc(m, k, trans_a, dnnl_bf16, lda);
  const dnnl_memory_desc_t b_md = matrix_desc(k, n, trans_b, dnnl_bf16, ldb);
  const dnnl_memory_desc_t c_md = matrix_desc(m, n, false, dnnl_type(c_dtype), ldc);
  // oneDNN memory objects over our buffers (no copy); it takes non-const handles but only reads the sources.
  dnnl_memory_t a_mem = nullptr, b_mem = nullptr, c_mem = nullptr;
  check(dnnl_memory_create(&a_mem, &a_md, cpu_engine(), const_cast<bf16*>(A)), "memory A");
  check(dnnl_memory_create(&b_mem, &b_md, cpu_engine(), const_cast<bf16*>(B)), "memory B");
  check(dnnl_memory_create(&c_mem, &c_md, cpu_engine(), C), "memory C");
  const dnnl_exec_arg_t args[] = {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}};
  const dnnl_status_t ran = dnnl_primitive_execute(it->second, mine.stream, 3, args);
  const dnnl_status_t waited = ran == dnnl_success ? dnnl_stream_wait(mine.stream) : ran;
  dnnl_memory_destroy(a_mem);
  dnnl_memory_destroy(b_mem);
  dnnl_memory_destroy(c_mem);
  check(waited, "bf16 matmul");
}

namespace {

// oneDNN 2.6 implements bf16 matmuls from avx512_core up; below it primitive creation says "unimplemented".
bool onednn_has_bf16_matmul() {
  const OneThreadForOneDnn one_thread;
  constexpr int64_t kProbe = 2;  // any shape: the answer depends on the ISA, not on the shape
  try {
    dnnl_primitive_destroy(
        make_matmul(PrimitiveKey{false, false, kProbe, kProbe, kProbe, kProbe, kProbe, kProbe, 1.f, 0.f, DType::F32}));
    return true;
  } catch (const Error&) {
    return false;
  }
}

Bf16MatmulPath choose_bf16_matmul_path() {
  constexpr const char* kSgemm =
      "operands rounded to bf16, multiplied by float32 sgemm (the same numbers, float32's speed)";
  if (!onednn_has_bf16_matmul()) return {rf::concat("no oneDNN bf16 matmul on this CPU (no AVX-512): ", kSgemm), false};
  const dnnl_cpu_isa_t isa = dnnl_get_effective_cpu_isa();
  // dnnl_cpu_isa_t values are bit sets: an ISA includes the bits of every ISA it extends.
  const auto has = [isa](dnnl_cpu_isa_t want) { return (static_cast<unsigned>(isa) & want) == want; };
  if (has(dnnl_cpu_isa_avx512_core_amx)) return {"oneDNN avx512_core_amx (AMX bf16 tiles)", true};
  if (!has(dnnl_cpu_isa_avx512_core_bf16))
    return {rf::concat("oneDNN avx512_core has no bf16 units to use (no AVX512_BF16 or AMX): ", kSgemm), false};
  // vdpbf16ps pays only where the attention's choice of units (the tile race on Intel) says so.
  const cpu::KernelPath& kernels = cpu::kernel_path();
  if (!cpu::bf16_units_pay(kernels)) return {rf::concat("vdpbf16ps not used (", kernels.reason, "): ", kSgemm), false};
  return {"oneDNN avx512_core_bf16 (vdpbf16ps)", true};
}

}  // namespace

Bf16MatmulPath bf16_matmul_path() {
  static const Bf16MatmulPath path = choose_bf16_matmul_path();  // fixed for the process, as kernel_path() is
  return path;
}

bool bf16_matmul_on_onednn() { return bf16_matmul_path().on_onednn; }

}  // namespace rf::model
