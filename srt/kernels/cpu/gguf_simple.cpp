// QuantRowOps of Q4_0, Q4_1 and Q8_0 (row functions in gguf_simple_rows.h): the AVX2 table on
// CPUs with AVX2 and FMA (AVX-512 CPUs included), the scalar one otherwise.
#include "gguf_simple_rows.h"

namespace srt_cpu {

namespace {
namespace gs = gguf_simple;

constexpr QuantRowOps kScalarQ4_0 = scalar_row_ops<&gs::scalar::dequant_block_q4_0, gs::kBlock, gs::kSizeQ4_0>();
constexpr QuantRowOps kScalarQ4_1 = scalar_row_ops<&gs::scalar::dequant_block_q4_1, gs::kBlock, gs::kSizeQ4_1>();
constexpr QuantRowOps kScalarQ8_0 = scalar_row_ops<&gs::scalar::dequant_block_q8_0, gs::kBlock, gs::kSizeQ8_0>();

#if SRT_CPU_X86
namespace av = gguf_simple::avx2;
template <class B>
constexpr QuantRowOps avx2_ops{gs::kBlock, B::kSize, &av::dequant_row<B>, &av::dot_rows<B>};
#endif

}  // namespace

const QuantRowOps* simple_quant_ops(int qtype, CpuIsa isa) {
#if SRT_CPU_X86
  if (isa == CpuIsa::kAvx2 || isa == CpuIsa::kAvx512) {
    switch (qtype) {
      case kGgmlQ4_0: return &avx2_ops<av::BlockQ4_0>;
      case kGgmlQ4_1: return &avx2_ops<av::BlockQ4_1>;
      case kGgmlQ8_0: return &avx2_ops<av::BlockQ8_0>;
      default: return nullptr;
    }
  }
#endif
  switch (qtype) {
    case kGgmlQ4_0: return &kScalarQ4_0;
    case kGgmlQ4_1: return &kScalarQ4_1;
    case kGgmlQ8_0: return &kScalarQ8_0;
    default: return nullptr;
  }
}

}  // namespace srt_cpu
