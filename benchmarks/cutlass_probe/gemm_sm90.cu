// One CUTLASS 3.x Hopper GEMM configuration, out^T = W x^T (the weight tile on wgmma's M side,
// the batch's rows on N, as triton_gemm_tma's swap_ab), exported with a C ABI so that a probe
// can load it with ctypes into any torch build. The configuration comes from -D flags:
//   CFG (the exported suffix), TM TN TK (tile), CM CN (cluster), SCHED 0/1/2 (cooperative,
//   ping-pong, basic warp-specialized), STREAMK 0/1 (tile scheduler).
// Why: the 128-row decode GEMMs re-read x from L2 once per weight tile; a cluster shares that
// tile through TMA multicast, which Triton 3.6 cannot express (docs/BENCHMARKS.md).
#include <cuda_runtime.h>
#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>
#include <cutlass/util/packed_stride.hpp>

using namespace cute;

#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)

namespace {
using Elt = cutlass::bfloat16_t;
using Acc = float;
using TileShape = Shape<Int<TM>, Int<TN>, Int<TK>>;
using ClusterShape = Shape<Int<CM>, Int<CN>, _1>;
#if SCHED == 0
using MainSchedule = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using EpiSchedule = cutlass::epilogue::TmaWarpSpecializedCooperative;
#elif SCHED == 1
using MainSchedule = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using EpiSchedule = cutlass::epilogue::TmaWarpSpecialized;
#else
using MainSchedule = cutlass::gemm::KernelTmaWarpSpecialized;
using EpiSchedule = cutlass::epilogue::TmaWarpSpecialized;
#endif
#if STREAMK
using Scheduler = cutlass::gemm::StreamKScheduler;
#else
using Scheduler = cutlass::gemm::PersistentScheduler;
#endif

using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, Acc, Acc, void, cutlass::layout::ColumnMajor,
    8, Elt, cutlass::layout::ColumnMajor, 8, EpiSchedule>::CollectiveOp;
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Elt, cutlass::layout::RowMajor, 8, Elt,
    cutlass::layout::ColumnMajor, 8, Acc, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
        sizeof(typename Epilogue::SharedStorage))>,
    MainSchedule>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                    Scheduler>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

typename Gemm::Arguments arguments(const void* w, const void* x, void* out, int rows, int batch,
                                   int k, int mode, int splits) {
  auto stride_a = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, {rows, k, 1});
  auto stride_b = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, {batch, k, 1});
  auto stride_d = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, {rows, batch, 1});
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {rows, batch, k, 1},
                                {static_cast<const Elt*>(w), stride_a, static_cast<const Elt*>(x),
                                 stride_b},
                                {{1.f, 0.f}, nullptr, stride_d, static_cast<Elt*>(out), stride_d}};
#if STREAMK
  using Mode = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90StreamKParams::
      DecompositionMode;
  args.scheduler.splits = splits;
  args.scheduler.decomposition_mode = mode == 1   ? Mode::DataParallel
                                      : mode == 2 ? Mode::SplitK
                                      : mode == 3 ? Mode::StreamK
                                                  : Mode::Heuristic;
#endif
  return args;
}
}  // namespace

// Workspace bytes the call needs (stream-K's partials and locks), or -1 if it cannot run.
extern "C" long long CAT(workspace_, CFG)(int rows, int batch, int k, int mode, int splits) {
  auto args = arguments(nullptr, nullptr, nullptr, rows, batch, k, mode, splits);
  if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return -1;
  return static_cast<long long>(Gemm::get_workspace_size(args));
}

// out [batch, rows] (row-major) = x [batch, k] @ w [rows, k]^T on `stream`; 0 on success.
extern "C" int CAT(gemm_, CFG)(const void* w, const void* x, void* out, int rows, int batch,
                               int k, int mode, int splits, void* workspace, void* stream) {
  auto args = arguments(w, x, out, rows, batch, k, mode, splits);
  Gemm gemm;
  auto s = static_cast<cudaStream_t>(stream);
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return 1;
  if (gemm.initialize(args, workspace, s) != cutlass::Status::kSuccess) return 2;
  if (gemm.run(s) != cutlass::Status::kSuccess) return 3;
  return cudaGetLastError() == cudaSuccess ? 0 : 4;
}
