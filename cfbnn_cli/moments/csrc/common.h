/* What the operators' units (moment_ops.cpp, elbo_ops.cpp) share: each kernel of kernels.h by element
 * type, the operand checks (a wrong dtype or shape raises a ValueError naming the operator; it never
 * reaches a kernel as a raw pointer), and the moments operators' allocation around their kernels. */
#ifndef CFBNN_COMMON_H
#define CFBNN_COMMON_H

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>

#include "kernels.h"

namespace cfbnn {
namespace ops {

using at::Tensor;

/* Each kernel of kernels.h by element type. */
template <typename T>
struct Kernels;
#define CFBNN_KERNEL_TABLE(T, SUF)                                       \
  template <>                                                            \
  struct Kernels<T> {                                                    \
    static constexpr auto family_forward = &kernels::family_forward_##SUF;        \
    static constexpr auto relu_mean = &kernels::relu_mean_##SUF;                  \
    static constexpr auto count_negative = &kernels::count_negative_##SUF;        \
    static constexpr auto family_backward = &kernels::family_backward_##SUF;      \
    static constexpr auto hidden_pass = &kernels::hidden_pass_##SUF;              \
    static constexpr auto diag_kl_backward = &kernels::diag_kl_backward_##SUF;    \
    static constexpr auto augment_pair = &kernels::augment_pair_##SUF;            \
    static constexpr auto diag_kl_sums = &kernels::diag_kl_sums_##SUF;            \
    static constexpr auto diag_kl_table = &kernels::diag_kl_table_##SUF;          \
    static constexpr auto diag_gradient_finish = &kernels::diag_gradient_finish_##SUF; \
    static constexpr auto normal_rows = &kernels::normal_rows_##SUF;              \
    static constexpr auto normal_row_gradients = &kernels::normal_row_gradients_##SUF; \
    static constexpr auto normal_output_gradients = &kernels::normal_output_gradients_##SUF; \
    static constexpr auto tail_pass = &kernels::tail_pass_##SUF;                  \
    static constexpr auto pw_forward = &kernels::pw_forward_##SUF;                \
    static constexpr auto partials_backward = &kernels::partials_backward_##SUF;  \
  };
CFBNN_KERNEL_TABLE(float, f32)
CFBNN_KERNEL_TABLE(double, f64)
#undef CFBNN_KERNEL_TABLE

inline const double LOG_2PI = std::log(2.0 * M_PI);
inline const double LOG_MAX_DOUBLE = std::log(DBL_MAX);
enum { TAIL_FORWARD = 0, TAIL_BACKWARD = 1, TAIL_AHEAD = 2 };  // tail_pass's modes

inline int threads() { return at::get_num_threads(); }

/* float32 or float64, the same for every tensor given (a mixed call must never reach a kernel). */
inline void check_floats(const char* op, const Tensor& first, std::initializer_list<const Tensor*> others) {
  TORCH_CHECK_VALUE(first.scalar_type() == at::kFloat || first.scalar_type() == at::kDouble, "cfbnn::", op,
                    ": the CPU kernels take float32 or float64 tensors; got ", first.scalar_type());
  for (const Tensor* other : others) {
    TORCH_CHECK_VALUE(other->scalar_type() == first.scalar_type(), "cfbnn::", op,
                      ": every tensor must have one dtype; got ", first.scalar_type(), " and ",
                      other->scalar_type());
  }
}

inline void check_numel(const char* op, const char* name, const Tensor& tensor, int64_t expected) {
  TORCH_CHECK_VALUE(tensor.numel() == expected, "cfbnn::", op, ": `", name, "` must have ", expected,
                    " elements; got shape ", tensor.sizes());
}

/* (log tau, tau) as numbers; tau +inf past the float64 range, as torch.exp gives (an L-BFGS line
   search probes such steps and must see the reference path's -inf). */
inline std::pair<double, double> precision(const Tensor& log_precision) {
  const double log_beta = log_precision.item<double>();
  return {log_beta, log_beta < LOG_MAX_DOUBLE ? std::exp(log_beta) : std::numeric_limits<double>::infinity()};
}

template <typename F>
auto by_dtype(const Tensor& like, F&& body) {
  if (like.scalar_type() == at::kDouble) return body(double{});
  return body(float{});
}
/* Every tensor of `mean`'s shape and of one float dtype (cfbnn_cli/moments/operators.py: check_operands). */
inline void check_operands(const char* op, const Tensor& mean, std::initializer_list<const Tensor*> others) {
  check_floats(op, mean, others);
  for (const Tensor* other : others) {
    TORCH_CHECK_VALUE(other->sizes() == mean.sizes(), "cfbnn::", op, ": every tensor must have the shape of `mean` ",
                      mean.sizes(), "; got ", other->sizes());
  }
}

/* What the moments' forward operators do around their kernel: check the operands, make them
   contiguous, allocate (Phi, Upsilon, Var), then kernel(T{}, n, mean, spread, phi, ups, var). */
template <typename Kernel>
std::tuple<Tensor, Tensor, Tensor> moments_forward(const char* op, const Tensor& mean_in, const Tensor& spread_in,
                                                   Kernel&& kernel) {
  check_operands(op, mean_in, {&spread_in});
  const Tensor mean = mean_in.contiguous(), spread = spread_in.contiguous();
  Tensor phi = at::empty_like(mean), ups = at::empty_like(mean), var = at::empty_like(mean);
  by_dtype(mean, [&](auto zero) {
    using T = decltype(zero);
    kernel(zero, mean.numel(), mean.data_ptr<T>(), spread.data_ptr<T>(), phi.data_ptr<T>(), ups.data_ptr<T>(),
           var.data_ptr<T>());
    return 0;
  });
  return {phi, ups, var};
}

/* One output gradient of the ReLU backward kernel as (pointer, is_scalar). A tensor expanded from one
   value -- what sum()'s backward hands over, or the zero the autograd registration passes for an
   unused output -- passes that value instead of a materialized copy, and an expanded zero no
   pointer at all (the kernel's zero, which lets it take its dense path); `held` keeps the memory. */
template <typename T>
std::pair<const T*, int> gradient_operand(const Tensor& grad, Tensor& held) {
  const auto strides = grad.strides();
  const bool broadcast = grad.numel() > 0 && std::all_of(strides.begin(), strides.end(), [](int64_t s) { return s == 0; });
  if (!broadcast) {
    held = grad.contiguous();
    return {held.data_ptr<T>(), 0};
  }
  held = grad;
  const T* value = grad.data_ptr<T>();
  if (*value == T(0)) return {nullptr, 0};
  return {value, 1};
}

/* What both moments' backward operators do around their kernel: check the operands, make the
   inputs contiguous, pass each output gradient as (pointer, is_scalar) (gradient_operand), then
   kernel(T{}, n, mean, std, phi, gp, gp_scalar, gu, gu_scalar, gv, gv_scalar, grad_mean, grad_std). */
template <typename Kernel>
std::tuple<Tensor, Tensor> moments_backward(const char* op, const Tensor& mean_in, const Tensor& std_in,
                                            const Tensor& phi_in, const Tensor& grad_phi, const Tensor& grad_upsilon,
                                            const Tensor& grad_variance, Kernel&& kernel) {
  check_operands(op, mean_in, {&std_in, &phi_in, &grad_phi, &grad_upsilon, &grad_variance});
  const Tensor mean = mean_in.contiguous(), std_dev = std_in.contiguous(), phi = phi_in.contiguous();
  Tensor grad_mean = at::empty_like(mean), grad_std = at::empty_like(mean);
  by_dtype(mean, [&](auto zero) {
    using T = decltype(zero);
    Tensor held[3];
    const auto [gp, gp_scalar] = gradient_operand<T>(grad_phi, held[0]);
    const auto [gu, gu_scalar] = gradient_operand<T>(grad_upsilon, held[1]);
    const auto [gv, gv_scalar] = gradient_operand<T>(grad_variance, held[2]);
    kernel(zero, mean.numel(), mean.data_ptr<T>(), std_dev.data_ptr<T>(), phi.data_ptr<T>(), gp, gp_scalar, gu,
           gu_scalar, gv, gv_scalar, grad_mean.data_ptr<T>(), grad_std.data_ptr<T>());
    return 0;
  });
  return {grad_mean, grad_std};
}

/* The slope as the kernels take it: for float32 tensors the float32 number torch's float32
   arithmetic multiplies by (cfbnn_cli/moments/relu_family.py: slope_for). */
template <typename T>
double slope_for(double negative_slope) {
  return sizeof(T) == sizeof(float) ? static_cast<double>(static_cast<float>(negative_slope)) : negative_slope;
}

/* `activation` one of the ReLU family's kinds (cfbnn_cli/moments/relu_family.py: ACTIVATION_KINDS). */
inline void check_activation(const char* op, int64_t activation) {
  TORCH_CHECK_VALUE(activation >= 0 && activation < kernels::FAMILY_SIZE, "cfbnn::", op, ": `activation` must be one of ",
                    "the ReLU family's members 0 .. ", kernels::FAMILY_SIZE - 1, " (cfbnn_cli/moments/relu_family.py); got ",
                    activation);
}

}  // namespace ops
}  // namespace cfbnn

#endif
