/* The CPU kernels of the closed-form ELBO's operators (cfbnn::*), registered with torch's
 * dispatcher in C++.
 *
 * The operators' schemas, their CUDA (Triton) kernels and their fake implementations are
 * defined in Python (cfbnn_cli/moments/elbo_ops.py, tail_ops.py, ops.py, piecewise_ops.py, ...); this unit gives each its CPU
 * kernel: argument checks with typed tensors (a wrong dtype or shape raises, it never reaches a
 * kernel as a raw pointer), output allocation, and a call into the kernels of
 * cfbnn_moments.cpp (declared in cfbnn_kernels.h). A call costs a few microseconds of dispatch,
 * where a Python kernel calling the same C function through ctypes costs about twenty.
 *
 * The activations' moments operators also get their autograd here (MomentsAutograd, registered for
 * AutogradCPU): on the CPU a forward + backward then never enters Python, which the operators'
 * Python autograd registrations (still serving CUDA) cost about a fifth of a 500 x 200 call.
 *
 * It includes torch's core tensor, autograd and library headers (it compiles beside the kernels'
 * unit in about the time that one takes) and is linked with the kernels into one library by
 * cfbnn_cli/moments/kernel_build.py; cfbnn_cli/moments/kernel_library.py calls
 * cfbnn_register_cpu_kernels() once that library has loaded and passed its self-test. */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <string>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cfbnn_kernels.h"

namespace {

using at::Tensor;

/* Each kernel of cfbnn_kernels.h by element type. */
template <typename T>
struct Kernels;
#define CFBNN_KERNEL_TABLE(T, SUF)                                       \
  template <>                                                            \
  struct Kernels<T> {                                                    \
    static constexpr auto family_forward = &family_forward_##SUF;        \
    static constexpr auto relu_mean = &relu_mean_##SUF;                  \
    static constexpr auto count_negative = &count_negative_##SUF;        \
    static constexpr auto family_backward = &family_backward_##SUF;      \
    static constexpr auto hidden_pass = &hidden_pass_##SUF;              \
    static constexpr auto diag_kl_backward = &diag_kl_backward_##SUF;    \
    static constexpr auto augment_pair = &augment_pair_##SUF;            \
    static constexpr auto diag_kl_sums = &diag_kl_sums_##SUF;            \
    static constexpr auto diag_kl_table = &diag_kl_table_##SUF;          \
    static constexpr auto diag_gradient_finish = &diag_gradient_finish_##SUF; \
    static constexpr auto normal_rows = &normal_rows_##SUF;              \
    static constexpr auto normal_row_gradients = &normal_row_gradients_##SUF; \
    static constexpr auto normal_output_gradients = &normal_output_gradients_##SUF; \
    static constexpr auto tail_pass = &tail_pass_##SUF;                  \
    static constexpr auto pw_forward = &pw_forward_##SUF;                \
    static constexpr auto partials_backward = &partials_backward_##SUF;  \
  };
CFBNN_KERNEL_TABLE(float, f32)
CFBNN_KERNEL_TABLE(double, f64)
#undef CFBNN_KERNEL_TABLE

const double LOG_2PI = std::log(2.0 * M_PI);
const double LOG_MAX_DOUBLE = std::log(DBL_MAX);
enum { TAIL_FORWARD = 0, TAIL_BACKWARD = 1, TAIL_AHEAD = 2 };  // tail_pass's modes

int threads() { return at::get_num_threads(); }

/* float32 or float64, the same for every tensor given (a mixed call must never reach a kernel). */
void check_floats(const char* op, const Tensor& first, std::initializer_list<const Tensor*> others) {
  TORCH_CHECK_VALUE(first.scalar_type() == at::kFloat || first.scalar_type() == at::kDouble, "cfbnn::", op,
                    ": the CPU kernels take float32 or float64 tensors; got ", first.scalar_type());
  for (const Tensor* other : others) {
    TORCH_CHECK_VALUE(other->scalar_type() == first.scalar_type(), "cfbnn::", op,
                      ": every tensor must have one dtype; got ", first.scalar_type(), " and ",
                      other->scalar_type());
  }
}

void check_numel(const char* op, const char* name, const Tensor& tensor, int64_t expected) {
  TORCH_CHECK_VALUE(tensor.numel() == expected, "cfbnn::", op, ": `", name, "` must have ", expected,
                    " elements; got shape ", tensor.sizes());
}

/* (log tau, tau) as numbers; tau +inf past the float64 range, as torch.exp gives (an L-BFGS line
   search probes such steps and must see the reference path's -inf). */
std::pair<double, double> precision(const Tensor& log_precision) {
  const double log_beta = log_precision.item<double>();
  return {log_beta, log_beta < LOG_MAX_DOUBLE ? std::exp(log_beta) : std::numeric_limits<double>::infinity()};
}

template <typename F>
auto by_dtype(const Tensor& like, F&& body) {
  if (like.scalar_type() == at::kDouble) return body(double{});
  return body(float{});
}

/* The number of entries < 0 of a float tensor, one pass (the argument checks' sign test:
   cfbnn_cli/moments/gaussian.py, check_mean_std). */
int64_t count_negative(const Tensor& x_in) {
  check_floats("count_negative", x_in, {});
  const Tensor x = x_in.contiguous();
  return by_dtype(x, [&](auto zero) {
    using T = decltype(zero);
    return static_cast<int64_t>(Kernels<T>::count_negative(x.numel(), x.data_ptr<T>(), threads()));
  });
}

// ------------------------------------------------------------------------- ReLU moments and the KL

/* Every tensor of `mean`'s shape and of one float dtype (cfbnn_cli/moments/ops.py: check_operands). */
void check_operands(const char* op, const Tensor& mean, std::initializer_list<const Tensor*> others) {
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

/* E[relu(z)] alone: the prediction's moments kernel without Upsilon, Var and the saved factors. */
Tensor relu_mean(const Tensor& mean_in, const Tensor& std_in) {
  check_operands("relu_mean", mean_in, {&std_in});
  const Tensor mean = mean_in.contiguous(), std_dev = std_in.contiguous();
  Tensor phi = at::empty_like(mean);
  by_dtype(mean, [&](auto zero) {
    using T = decltype(zero);
    Kernels<T>::relu_mean(mean.numel(), mean.data_ptr<T>(), std_dev.data_ptr<T>(), phi.data_ptr<T>(), threads());
    return 0;
  });
  return phi;
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
void check_activation(const char* op, int64_t activation) {
  TORCH_CHECK_VALUE(activation >= 0 && activation < family_size(), "cfbnn::", op, ": `activation` must be one of ",
                    "the ReLU family's members 0 .. ", family_size() - 1, " (cfbnn_cli/moments/relu_family.py); got ",
                    activation);
}

/* cfbnn::relu_family_moments: (Phi, Upsilon, Var) of the family's member `activation`, from the
   standard deviations, or from the variances (from_variance: the square root taken inside, the
   variance floored at the dtype's smallest normal number). */
std::tuple<Tensor, Tensor, Tensor> relu_family_moments(const Tensor& mean, const Tensor& spread, int64_t activation,
                                                       double negative_slope, bool from_variance) {
  check_activation("relu_family_moments", activation);
  return moments_forward("relu_family_moments", mean, spread,
                         [=](auto zero, int64_t n, const auto* m, const auto* s, auto* f, auto* u, auto* v) {
                           using T = decltype(zero);
                           const int kind = static_cast<int>(activation);
                           const double eps = slope_for<T>(negative_slope);
                           if (from_variance) {
                             Kernels<T>::hidden_pass(kind, 0, n, m, s, eps, f, u, v, nullptr, nullptr, nullptr,
                                                     nullptr, nullptr, 0, threads());
                           } else {
                             Kernels<T>::family_forward(kind, n, m, s, eps, f, u, v, threads());
                           }
                         });
}

/* Its vector-Jacobian product. From the variances phi is unread (Phi is recomputed from the
   variance; it is an operand so that every moments operator's backward has one schema) and the
   output gradients are read dense. */
std::tuple<Tensor, Tensor> relu_family_moments_backward(const Tensor& mean_in, const Tensor& spread_in,
                                                        const Tensor& phi_in, const Tensor& grad_phi,
                                                        const Tensor& grad_upsilon, const Tensor& grad_variance,
                                                        int64_t activation, double negative_slope,
                                                        bool from_variance) {
  const char* op = "relu_family_moments_backward";
  check_activation(op, activation);
  const int kind = static_cast<int>(activation);
  if (!from_variance) {
    return moments_backward(op, mean_in, spread_in, phi_in, grad_phi, grad_upsilon, grad_variance,
                            [=](auto zero, int64_t n, const auto* m, const auto* s, const auto* f, const auto* gp,
                                int gps, const auto* gu, int gus, const auto* gv, int gvs, auto* gm, auto* gs) {
                              using T = decltype(zero);
                              Kernels<T>::family_backward(kind, n, m, s, slope_for<T>(negative_slope), f, gp, gps,
                                                          gu, gus, gv, gvs, gm, gs, threads());
                            });
  }
  check_operands(op, mean_in, {&spread_in, &phi_in, &grad_phi, &grad_upsilon, &grad_variance});
  const Tensor mean = mean_in.contiguous(), variance = spread_in.contiguous();
  const Tensor gp = grad_phi.contiguous(), gu = grad_upsilon.contiguous(), gv = grad_variance.contiguous();
  Tensor grad_mean = at::empty_like(mean), grad_var = at::empty_like(mean);
  by_dtype(mean, [&](auto zero) {
    using T = decltype(zero);
    Kernels<T>::hidden_pass(kind, 1, mean.numel(), mean.data_ptr<T>(), variance.data_ptr<T>(),
                            slope_for<T>(negative_slope), nullptr, nullptr, nullptr, gp.data_ptr<T>(), gu.data_ptr<T>(),
                            gv.data_ptr<T>(), grad_mean.data_ptr<T>(), grad_var.data_ptr<T>(), 0, threads());
    return 0;
  });
  return {grad_mean, grad_var};
}

// ------------------------------------------------------------------------- piecewise polynomials

const int64_t PW_MAX_BREAKPOINTS = 64, PW_MAX_DEGREE = 16;  // cfbnn_moments.cpp: MAX_B, MAX_K / 2

/* The general engine's tables (cfbnn_cli/moments/piecewise_tables.py: coefficient_tables), read from
   the one float64 tensor cfbnn_cli/moments/piecewise_ops.py packs (bp, coef, deriv, side, tails,
   jumps, gl concatenated); coef32 and bp32 are coef and bp rounded to float32, made here. */
struct PiecewiseTable {
  int B = 0, D = 0;
  const double *bp = nullptr, *coef = nullptr, *deriv = nullptr, *side = nullptr, *tails = nullptr,
               *jumps = nullptr, *gl = nullptr;
  std::vector<float> coef32, bp32;
};

PiecewiseTable piecewise_table(const char* op, const Tensor& table, int64_t breakpoints, int64_t degree) {
  TORCH_CHECK_VALUE(breakpoints >= 0 && breakpoints <= PW_MAX_BREAKPOINTS && degree >= 0 && degree <= PW_MAX_DEGREE,
                    "cfbnn::", op, ": at most ", PW_MAX_BREAKPOINTS, " breakpoints and degree ", PW_MAX_DEGREE,
                    "; got ", breakpoints, " and ", degree);
  TORCH_CHECK_VALUE(table.scalar_type() == at::kDouble && table.dim() == 1 && table.device().is_cpu(), "cfbnn::", op,
                    ": `table` must be a one-dimensional float64 CPU tensor; got ", table.scalar_type(), " ",
                    table.sizes(), " on ", table.device());
  const int64_t B = breakpoints, D = degree, P = B + 1, K = 2 * D, rows = std::max<int64_t>(B, 1);
  const int64_t sizes[7] = {rows, P * (D + 1), P * (D + 1) * (D + 1), P * 2, P * 2 * 6 * (K + 1), rows * 4, 32};
  int64_t total = 0;
  for (int64_t size : sizes) total += size;
  check_numel(op, "table", table, total);
  PiecewiseTable out;
  out.B = static_cast<int>(B);
  out.D = static_cast<int>(D);
  const double* base = table.data_ptr<double>();  // (contiguous: checked by the caller's .contiguous())
  const double** fields[7] = {&out.bp, &out.coef, &out.deriv, &out.side, &out.tails, &out.jumps, &out.gl};
  for (int k = 0; k < 7; k++) {
    *fields[k] = base;
    base += sizes[k];
  }
  out.bp32.assign(out.bp, out.bp + sizes[0]);
  out.coef32.assign(out.coef, out.coef + sizes[1]);
  return out;
}

/* alpha: the hard sigmoid's (its unrolled float32 kernels) where finite and non-zero; nan: the engine. */
bool hard_sigmoid_kernels(double alpha) { return std::isfinite(alpha) && alpha != 0.0; }

/* Whether the kernel for these tensors saves the four partial derivatives when asked: the engine
   does; the float32 hard sigmoid recomputes them in its backward (cheaper than writing them). */
bool saves_partials(const Tensor& mean, double alpha) {
  return !(mean.scalar_type() == at::kFloat && hard_sigmoid_kernels(alpha));
}

/* (Phi, Upsilon, Var, partials): partials (4, *mean.shape) = d(Phi, Var)/d(mean, std) where
   `partials` is asked and the kernel saves them (saves_partials), else an empty (0,) tensor. */
std::tuple<Tensor, Tensor, Tensor, Tensor> piecewise_forward(const char* op, const Tensor& mean_in,
                                                             const Tensor& std_in, const Tensor& table_in,
                                                             int64_t breakpoints, int64_t degree, double alpha,
                                                             bool partials) {
  check_operands(op, mean_in, {&std_in});
  const Tensor table_tensor = table_in.contiguous();
  const PiecewiseTable t = piecewise_table(op, table_tensor, breakpoints, degree);
  const Tensor mean = mean_in.contiguous(), std_dev = std_in.contiguous();
  Tensor phi = at::empty_like(mean), ups = at::empty_like(mean), var = at::empty_like(mean);
  const bool save = partials && saves_partials(mean, alpha);
  std::vector<int64_t> shape{save ? 4 : 0};
  if (save) shape.insert(shape.end(), mean.sizes().begin(), mean.sizes().end());
  Tensor saved = at::empty(shape, mean.options());
  by_dtype(mean, [&](auto zero) {
    using T = decltype(zero);
    const int64_t n = mean.numel();
    const T *m = mean.data_ptr<T>(), *s = std_dev.data_ptr<T>();
    T *f = phi.data_ptr<T>(), *u = ups.data_ptr<T>(), *v = var.data_ptr<T>();
    if constexpr (std::is_same_v<T, float>) {
      if (hard_sigmoid_kernels(alpha)) {
        hs_forward_f32(n, m, s, t.B, t.D, t.bp, t.coef, t.deriv, t.side, t.tails, t.jumps, t.gl, t.coef32.data(),
                       t.bp32.data(), std::fabs(alpha), alpha >= 0 ? 1.0 : -1.0, f, u, v, nullptr, nullptr, nullptr,
                       nullptr, threads());
        return 0;
      }
    }
    T* p = save ? saved.data_ptr<T>() : nullptr;
    Kernels<T>::pw_forward(n, m, s, t.B, t.D, t.bp, t.coef, t.deriv, t.side, t.tails, t.jumps, t.gl, t.coef32.data(),
                           t.bp32.data(), f, u, v, p, save ? p + n : nullptr, save ? p + 2 * n : nullptr,
                           save ? p + 3 * n : nullptr, threads());
    return 0;
  });
  return {phi, ups, var, saved};
}

std::tuple<Tensor, Tensor, Tensor> piecewise_moments(const Tensor& mean, const Tensor& std_dev, const Tensor& table,
                                                     int64_t breakpoints, int64_t degree, double alpha) {
  auto [phi, ups, var, saved] =
      piecewise_forward("piecewise_moments", mean, std_dev, table, breakpoints, degree, alpha, false);
  return {phi, ups, var};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> piecewise_moments_partials(const Tensor& mean, const Tensor& std_dev,
                                                                      const Tensor& table, int64_t breakpoints,
                                                                      int64_t degree, double alpha) {
  return piecewise_forward("piecewise_moments_partials", mean, std_dev, table, breakpoints, degree, alpha, true);
}

/* From the saved partials where given (piecewise_moments_partials'), else recomputed: the float32
   hard sigmoid's kernel block by block, the engine in one forward pass writing them; then combined
   with the gradients. */
std::tuple<Tensor, Tensor> piecewise_moments_backward(const Tensor& mean, const Tensor& std_dev, const Tensor& phi,
                                                      const Tensor& grad_phi, const Tensor& grad_upsilon,
                                                      const Tensor& grad_variance, const Tensor& table_in,
                                                      int64_t breakpoints, int64_t degree, double alpha,
                                                      const std::optional<Tensor>& partials_in) {
  const char* op = "piecewise_moments_backward";
  const Tensor table_tensor = table_in.contiguous();
  const PiecewiseTable t = piecewise_table(op, table_tensor, breakpoints, degree);
  const bool given = partials_in.has_value() && partials_in->defined() && partials_in->numel() > 0;
  Tensor partials;
  if (given) {
    check_floats(op, mean, {&*partials_in});
    check_numel(op, "partials", *partials_in, 4 * mean.numel());
    partials = partials_in->contiguous();
  }
  return moments_backward(
      op, mean, std_dev, phi, grad_phi, grad_upsilon, grad_variance,
      [&](auto zero, int64_t n, const auto* m, const auto* s, const auto* f, const auto* gp, int gps, const auto* gu,
          int gus, const auto* gv, int gvs, auto* gm, auto* gs) {
        using T = decltype(zero);
        const T* p = nullptr;
        Tensor buffers;
        if (given) {
          p = partials.data_ptr<T>();
        } else {
          if constexpr (std::is_same_v<T, float>) {
            if (hard_sigmoid_kernels(alpha)) {
              hs_backward_f32(n, m, s, t.B, t.D, t.bp, t.coef, t.deriv, t.side, t.tails, t.jumps, t.gl,
                              t.coef32.data(), t.bp32.data(), std::fabs(alpha), alpha >= 0 ? 1.0 : -1.0, f, gp, gps,
                              gu, gus, gv, gvs, gm, gs, threads());
              return;
            }
          }
          buffers = at::empty({6, n}, mean.options());
          T* b = buffers.data_ptr<T>();
          Kernels<T>::pw_forward(n, m, s, t.B, t.D, t.bp, t.coef, t.deriv, t.side, t.tails, t.jumps, t.gl,
                                 t.coef32.data(), t.bp32.data(), b + 4 * n, b + 5 * n, nullptr, b, b + n, b + 2 * n,
                                 b + 3 * n, threads());
          p = b;
        }
        Kernels<T>::partials_backward(n, f, p, p + n, p + 2 * n, p + 3 * n, gp, gps, gu, gus, gv, gvs, gm, gs,
                                      threads());
      });
}

void check_kl(const char* op, const Tensor& loc, const Tensor& log_scale, double prior_variance) {
  check_operands(op, loc, {&log_scale});
  TORCH_CHECK_VALUE(prior_variance > 0, "cfbnn::", op, ": `prior_variance` must be > 0; got ", prior_variance);
}

/* KL(N(loc, diag Var) || N(0, s^2 I)) from (sum Var, sum loc^2, sum log_scale): paper eq. (4)'s KL term. */
double kl_from_sums(const double* sums, double count, double prior_variance) {
  return 0.5 * ((sums[0] + sums[1]) / prior_variance - count + count * std::log(prior_variance)) - sums[2];
}

/* The three sums of the KL, with exp(2 log_scale) written into `variance` where it is defined. */
void kl_sums(const Tensor& loc, const Tensor& log_scale, double* sums, Tensor* variance) {
  by_dtype(loc, [&](auto zero) {
    using T = decltype(zero);
    Kernels<T>::diag_kl_sums(loc.numel(), loc.data_ptr<T>(), log_scale.data_ptr<T>(), sums,
                             variance != nullptr ? variance->data_ptr<T>() : nullptr, threads());
    return 0;
  });
}

Tensor diagonal_kl(const Tensor& loc_in, const Tensor& log_scale_in, double prior_variance) {
  check_kl("diagonal_kl", loc_in, log_scale_in, prior_variance);
  const Tensor loc = loc_in.contiguous(), log_scale = log_scale_in.contiguous();
  double sums[3];
  kl_sums(loc, log_scale, sums, nullptr);
  return at::scalar_tensor(kl_from_sums(sums, static_cast<double>(loc.numel()), prior_variance), loc.options());
}

std::tuple<Tensor, Tensor> diagonal_kl_backward(const Tensor& loc_in, const Tensor& log_scale_in, const Tensor& grad,
                                                double prior_variance) {
  check_kl("diagonal_kl_backward", loc_in, log_scale_in, prior_variance);
  const Tensor loc = loc_in.contiguous(), log_scale = log_scale_in.contiguous();
  const double value = grad.item<double>();
  Tensor grad_loc = at::empty_like(loc), grad_log_scale = at::empty_like(log_scale);
  by_dtype(loc, [&](auto zero) {
    using T = decltype(zero);
    Kernels<T>::diag_kl_backward(loc.numel(), loc.data_ptr<T>(), log_scale.data_ptr<T>(), value / prior_variance,
                                 value, grad_loc.data_ptr<T>(), grad_log_scale.data_ptr<T>(), threads());
    return 0;
  });
  return {grad_loc, grad_log_scale};
}

// ------------------------------------------------------------------------- forward steps

/* [x, 1] and [x^2, 1] (x and x^2 without bias) of an (N, D) input, for `op`. */
std::tuple<Tensor, Tensor> augmented(const char* op, const Tensor& x_in, bool bias) {
  check_floats(op, x_in, {});
  TORCH_CHECK_VALUE(x_in.dim() == 2, "cfbnn::", op, ": `x` must be (N, D); got shape ", x_in.sizes());
  const Tensor x = x_in.contiguous();
  if (!bias) return {x.clone(), at::mul(x, x)};
  const int64_t rows = x.size(0), columns = x.size(1);
  Tensor inputs = at::empty({rows, columns + 1}, x.options()), squares = at::empty_like(inputs);
  by_dtype(x, [&](auto zero) {
    using T = decltype(zero);
    Kernels<T>::augment_pair(rows, columns, x.data_ptr<T>(), inputs.data_ptr<T>(), squares.data_ptr<T>(),
                             threads());
    return 0;
  });
  return {inputs, squares};
}

std::tuple<Tensor, Tensor> augment_pair(const Tensor& x_in, bool bias) { return augmented("augment_pair", x_in, bias); }

const int64_t KL_BLOCK = 1024;  // a KL sums table's block (elbo_reference.KL_BLOCK)

int64_t kl_blocks(const Tensor& loc) { return (loc.numel() + KL_BLOCK - 1) / KL_BLOCK; }

/* A layer's rows of a KL sums table, from row `first` of `table`: exp(2 log_scale) into `variance`,
   loc^2 into `loc_square` where given. */
void kl_table(const Tensor& loc, const Tensor& log_scale, Tensor& table, int64_t first, Tensor& variance,
              Tensor* loc_square) {
  by_dtype(loc, [&](auto zero) {
    using T = decltype(zero);
    Kernels<T>::diag_kl_table(loc.numel(), loc.data_ptr<T>(), log_scale.data_ptr<T>(), KL_BLOCK,
                              table.data_ptr<double>() + 3 * first, variance.data_ptr<T>(),
                              loc_square != nullptr ? loc_square->data_ptr<T>() : nullptr, threads());
    return 0;
  });
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> outer_layers_pass(const Tensor& x_in, const Tensor& loc_in,
                                                                             const Tensor& log_scale_in,
                                                                             const Tensor& output_loc_in,
                                                                             const Tensor& output_log_scale_in,
                                                                             bool bias) {
  const char* op = "outer_layers_pass";
  check_floats(op, x_in, {&loc_in, &log_scale_in, &output_loc_in, &output_log_scale_in});
  check_numel(op, "log_scale", log_scale_in, loc_in.numel());
  check_numel(op, "output_log_scale", output_log_scale_in, output_loc_in.numel());
  auto [inputs, squares] = augmented(op, x_in, bias);
  const Tensor loc = loc_in.contiguous(), log_scale = log_scale_in.contiguous();
  const Tensor output_loc = output_loc_in.contiguous(), output_log_scale = output_log_scale_in.contiguous();
  const int64_t blocks = kl_blocks(loc);
  Tensor table = at::empty({blocks + kl_blocks(output_loc), 3}, loc.options().dtype(at::kDouble));
  Tensor variance = at::empty_like(log_scale), output_variance = at::empty_like(output_log_scale);
  Tensor output_loc_square = at::empty_like(output_loc);
  kl_table(loc, log_scale, table, 0, variance, nullptr);
  kl_table(output_loc, output_log_scale, table, blocks, output_variance, &output_loc_square);
  return {inputs, squares, variance, output_variance, output_loc_square, table};
}

std::tuple<Tensor, Tensor, Tensor> diagonal_kl_pass(const Tensor& loc_in, const Tensor& log_scale_in,
                                                    double prior_variance, bool loc_square) {
  check_floats("diagonal_kl_pass", loc_in, {&log_scale_in});
  check_numel("diagonal_kl_pass", "log_scale", log_scale_in, loc_in.numel());
  const Tensor loc = loc_in.contiguous(), log_scale = log_scale_in.contiguous();
  Tensor variance = at::empty_like(log_scale);
  double sums[3];
  kl_sums(loc, log_scale, sums, &variance);
  const double kl = kl_from_sums(sums, static_cast<double>(loc.numel()), prior_variance);
  return {at::scalar_tensor(kl, loc.options()), variance,
          loc_square ? at::mul(loc, loc) : at::empty({0}, loc.options())};
}

/* The rows of both likelihood steps: (residual, squares, ELL, sum ELL). */
std::tuple<Tensor, Tensor, Tensor, double> rows(const char* op, const Tensor& mean_sum, const Tensor& spread_sum,
                                                const Tensor& y, const Tensor& loc, const Tensor& log_scale,
                                                const Tensor& log_precision, bool bias) {
  check_floats(op, mean_sum, {&spread_sum, &y, &loc, &log_scale});
  const int64_t count = mean_sum.numel();
  check_numel(op, "spread_sum", spread_sum, count);
  check_numel(op, "y", y, count);
  check_numel(op, "log_scale", log_scale, loc.numel());
  check_numel(op, "log_precision", log_precision, 1);
  const int64_t width = loc.size(-1) - (bias ? 1 : 0);
  TORCH_CHECK_VALUE(width >= 0 && loc.numel() == loc.size(-1), "cfbnn::", op,
                    ": `loc` must be the one-output layer's (1, H [+ 1]); got shape ", loc.sizes());
  const auto [log_beta, beta] = precision(log_precision);
  double mean_bias = 0.0, spread_bias = 0.0;
  if (bias) {
    mean_bias = loc.reshape({-1})[width].item<double>();
    spread_bias = std::exp(2.0 * log_scale.reshape({-1})[width].item<double>());
  }
  const Tensor mean = mean_sum.contiguous(), spread = spread_sum.contiguous(), target = y.contiguous();
  Tensor residual = at::empty_like(mean), squares = at::empty_like(mean), ell = at::empty_like(mean);
  const double total = by_dtype(mean, [&](auto zero) {
    using T = decltype(zero);
    return Kernels<T>::normal_rows(count, mean.data_ptr<T>(), spread.data_ptr<T>(), target.data_ptr<T>(), mean_bias,
                                   spread_bias, beta, 0.5 * (log_beta - LOG_2PI), residual.data_ptr<T>(),
                                   squares.data_ptr<T>(), ell.data_ptr<T>());
  });
  return {residual, squares, ell, total};
}

std::tuple<Tensor, Tensor, Tensor> normal_ell_rows(const Tensor& mean_sum, const Tensor& spread_sum, const Tensor& y,
                                                   const Tensor& loc, const Tensor& log_scale,
                                                   const Tensor& log_precision, bool bias) {
  auto [residual, squares, ell, total] =
      rows("normal_ell_rows", mean_sum, spread_sum, y, loc, log_scale, log_precision, bias);
  (void)total;
  return {residual, squares, ell};
}

/* The KL of the layers whose rows make a KL sums table (float64 (parts, 3)), the rows added in order. */
double kl_from_table(const char* op, const Tensor& kl_sums, double prior_variance) {
  TORCH_CHECK_VALUE(kl_sums.scalar_type() == at::kDouble && kl_sums.dim() == 2 && kl_sums.size(1) == 3, "cfbnn::", op,
                    ": `kl_sums` must be float64 (parts, 3); got ", kl_sums.scalar_type(), " ", kl_sums.sizes());
  TORCH_CHECK_VALUE(prior_variance > 0, "cfbnn::", op, ": `prior_variance` must be > 0; got ", prior_variance);
  const Tensor table = kl_sums.contiguous();
  const double* row = table.data_ptr<double>();
  double sums[3] = {0.0, 0.0, 0.0};
  for (int64_t part = 0; part < table.size(0); part++, row += 3) {
    for (int k = 0; k < 3; k++) sums[k] += row[k];
  }
  return 0.5 * (sums[0] / prior_variance - sums[2] + sums[2] * std::log(prior_variance)) - sums[1];
}

std::tuple<Tensor, Tensor, Tensor> normal_elbo_rows(const Tensor& mean_sum, const Tensor& spread_sum,
                                                    const Tensor& y, const Tensor& loc, const Tensor& log_scale,
                                                    const Tensor& log_precision, const Tensor& kl_sums,
                                                    const std::optional<Tensor>& kl, double prior_variance,
                                                    double scale, bool bias) {
  const double total_kl = kl_from_table("normal_elbo_rows", kl_sums, prior_variance) +
                          (kl.has_value() ? kl->item<double>() : 0.0);
  auto [residual, squares, ell, total] =
      rows("normal_elbo_rows", mean_sum, spread_sum, y, loc, log_scale, log_precision, bias);
  (void)ell;
  return {residual, squares, at::scalar_tensor(scale * total - total_kl, mean_sum.options())};
}

// ------------------------------------------------------------------------- backward steps

std::tuple<Tensor, Tensor, Tensor, Tensor> normal_rows_backward(const Tensor& grad, const Tensor& residual_in,
                                                                const Tensor& squares_in,
                                                                const Tensor& log_precision, double scale,
                                                                bool row_grads) {
  check_floats("normal_rows_backward", residual_in, {&squares_in, &grad});
  const int64_t count = residual_in.numel();
  check_numel("normal_rows_backward", "squares", squares_in, count);
  check_numel("normal_rows_backward", "grad", grad, row_grads ? count : 1);
  const Tensor per_row = row_grads ? (scale == 1.0 ? grad.contiguous() : at::mul(grad, scale))
                                   : at::full_like(residual_in, grad.item<double>() * scale);
  const Tensor residual = residual_in.contiguous(), squares = squares_in.contiguous();
  const double beta = precision(log_precision).second;
  Tensor row_u = at::empty_like(residual), row_k = at::empty_like(residual);
  Tensor sums = at::empty({3}, residual.options().dtype(at::kDouble));
  by_dtype(residual, [&](auto zero) {
    using T = decltype(zero);
    Kernels<T>::normal_row_gradients(count, per_row.data_ptr<T>(), residual.data_ptr<T>(), squares.data_ptr<T>(),
                                     beta, row_u.data_ptr<T>(), row_k.data_ptr<T>(), sums.data_ptr<double>());
    return 0;
  });
  Tensor grad_log_precision = at::scalar_tensor(sums.data_ptr<double>()[2], log_precision.options());
  return {row_u, row_k, sums, grad_log_precision.reshape(log_precision.sizes())};
}

/* grad_loc <- data_scale grad_loc + dL/dKL loc / s^2 and grad_variance <- 2 data_scale Var grad_variance +
   dL/dKL (Var / s^2 - 1). */
void finish(const Tensor& loc, const Tensor& variance, Tensor& grad_loc, Tensor& grad_variance, double data_scale,
            double kl, double prior_variance) {
  by_dtype(loc, [&](auto zero) {
    using T = decltype(zero);
    Kernels<T>::diag_gradient_finish(loc.numel(), loc.data_ptr<T>(), variance.data_ptr<T>(), data_scale,
                                     2.0 * data_scale,
                                     kl / prior_variance, kl, grad_loc.data_ptr<T>(), grad_variance.data_ptr<T>(),
                                     threads());
    return 0;
  });
}

double kl_gradient(const Tensor& kl_grad, double kl_sign) {
  return kl_sign != 0.0 ? kl_sign * kl_grad.item<double>() : 0.0;  // kl_grad is not read where kl_sign is 0
}

/* The data term's gradients' factor: 1, or the upstream gradient where they were taken at a unit one. */
double scale_of(const std::optional<Tensor>& data_scale) {
  return data_scale.has_value() ? data_scale->item<double>() : 1.0;
}

std::tuple<Tensor, Tensor> output_layer_gradients(const Tensor& columns_in, const Tensor& sums, const Tensor& loc_in,
                                                  const Tensor& log_scale_in, const Tensor& kl_grad, double kl_sign,
                                                  double prior_variance, bool bias,
                                                  const std::optional<Tensor>& data_scale) {
  check_floats("output_layer_gradients", loc_in, {&log_scale_in});
  TORCH_CHECK_VALUE(columns_in.scalar_type() == at::kDouble && columns_in.dim() == 2 && columns_in.size(0) == 3,
                    "cfbnn::output_layer_gradients: `columns` must be float64 (3, H); got ",
                    columns_in.scalar_type(), " ", columns_in.sizes());
  TORCH_CHECK_VALUE(sums.scalar_type() == at::kDouble && sums.numel() == 3,
                    "cfbnn::output_layer_gradients: `sums` must be float64 (3,); got ", sums.scalar_type(), " ",
                    sums.sizes());
  const int64_t width = columns_in.size(1);
  check_numel("output_layer_gradients", "loc", loc_in, width + (bias ? 1 : 0));
  check_numel("output_layer_gradients", "log_scale", log_scale_in, loc_in.numel());
  const Tensor loc = loc_in.contiguous(), columns = columns_in.contiguous();
  Tensor grad_loc = at::empty_like(loc), grad_variance = at::empty_like(loc);
  const Tensor sums_cpu = sums.contiguous();
  const double sum_u = sums_cpu.data_ptr<double>()[0], sum_k = sums_cpu.data_ptr<double>()[1];
  const Tensor variance = log_scale_in.mul(2.0).exp_().contiguous();
  by_dtype(loc, [&](auto zero) {
    using T = decltype(zero);
    Kernels<T>::normal_output_gradients(width, columns.data_ptr<double>(), loc.data_ptr<T>(), bias ? 1 : 0, sum_u,
                                        sum_k, scale_of(data_scale), grad_loc.data_ptr<T>(),
                                        grad_variance.data_ptr<T>());
    return 0;
  });
  finish(loc, variance, grad_loc, grad_variance, 1.0, kl_gradient(kl_grad, kl_sign), prior_variance);
  return {grad_loc, grad_variance};
}

void finish_diagonal_gradients(Tensor grad_loc, Tensor grad_variance, const Tensor& loc_in, const Tensor& variance_in,
                               const Tensor& kl_grad, double kl_sign, double prior_variance,
                               const std::optional<Tensor>& data_scale) {
  check_floats("finish_diagonal_gradients", grad_loc, {&grad_variance, &loc_in, &variance_in});
  TORCH_CHECK_VALUE(grad_loc.is_contiguous() && grad_variance.is_contiguous(),
                    "cfbnn::finish_diagonal_gradients: the gradients it finishes in place must be contiguous");
  const int64_t count = loc_in.numel();
  check_numel("finish_diagonal_gradients", "grad_loc", grad_loc, count);
  check_numel("finish_diagonal_gradients", "grad_variance", grad_variance, count);
  check_numel("finish_diagonal_gradients", "variance", variance_in, count);
  const Tensor loc = loc_in.contiguous(), variance = variance_in.contiguous();
  finish(loc, variance, grad_loc, grad_variance, scale_of(data_scale), kl_gradient(kl_grad, kl_sign),
         prior_variance);
}

// ------------------------------------------------------------------------- the ReLU tail pass

void check_tail(const char* op, const Tensor& mean, const Tensor& variance,
                std::initializer_list<const Tensor*> weights) {
  check_floats(op, mean, {&variance});
  TORCH_CHECK_VALUE(mean.dim() == 2 && variance.sizes() == mean.sizes(), "cfbnn::", op,
                    ": `mean` and `variance` must be (rows, H) of one shape; got ", mean.sizes(), " and ",
                    variance.sizes());
  for (const Tensor* weight : weights) {
    TORCH_CHECK_VALUE(weight->dim() == 1 && weight->size(0) == mean.size(1) &&
                          weight->scalar_type() == mean.scalar_type(),
                      "cfbnn::", op, ": each weight must be (", mean.size(1), ",) of dtype ", mean.scalar_type(),
                      "; got ", weight->sizes(), " ", weight->scalar_type());
  }
}

/* The ReLU family's kind for tail_pass (check_activation; a leaky ReLU's slope as the kernels take
   it, slope_for). */
int64_t tail_kind(const char* op, int64_t activation) {
  check_activation(op, activation);
  return activation;
}

std::tuple<Tensor, Tensor> relu_tail(const Tensor& mean_in, const Tensor& variance_in, const Tensor& weight_phi_in,
                                     const Tensor& weight_variance_in, const Tensor& weight_second_in,
                                     int64_t activation, double negative_slope) {
  check_tail("relu_tail", mean_in, variance_in, {&weight_phi_in, &weight_variance_in, &weight_second_in});
  const int kind = static_cast<int>(tail_kind("relu_tail", activation));
  const Tensor mean = mean_in.contiguous(), variance = variance_in.contiguous();
  const Tensor wp = weight_phi_in.contiguous(), wv = weight_variance_in.contiguous(),
               wu = weight_second_in.contiguous();
  const int64_t rows_count = mean.size(0), width = mean.size(1);
  Tensor mean_sum = at::empty({rows_count}, mean.options()), spread_sum = at::empty({rows_count}, mean.options());
  by_dtype(mean, [&](auto zero) {
    using T = decltype(zero);
    Kernels<T>::tail_pass(kind, TAIL_FORWARD, rows_count, width, mean.data_ptr<T>(), variance.data_ptr<T>(),
                          slope_for<T>(negative_slope), wp.data_ptr<T>(), wv.data_ptr<T>(), wu.data_ptr<T>(), nullptr,
                          nullptr, nullptr, 0.0, 0.0, 0.0, mean_sum.data_ptr<T>(), spread_sum.data_ptr<T>(), nullptr,
                          nullptr, nullptr, threads());
    return 0;
  });
  return {mean_sum, spread_sum};
}

std::tuple<Tensor, Tensor, Tensor> relu_tail_backward(const Tensor& mean_in, const Tensor& variance_in,
                                                      const Tensor& weight_phi_in, const Tensor& weight_variance_in,
                                                      const Tensor& weight_second_in, const Tensor& grad_mean_in,
                                                      const Tensor& grad_spread_in, int64_t activation,
                                                      double negative_slope) {
  check_tail("relu_tail_backward", mean_in, variance_in, {&weight_phi_in, &weight_variance_in, &weight_second_in});
  const int kind = static_cast<int>(tail_kind("relu_tail_backward", activation));
  const int64_t rows_count = mean_in.size(0), width = mean_in.size(1);
  for (const Tensor* grad : {&grad_mean_in, &grad_spread_in}) {
    TORCH_CHECK_VALUE(grad->dim() == 1 && grad->size(0) == rows_count && grad->scalar_type() == mean_in.scalar_type(),
                      "cfbnn::relu_tail_backward: the row gradients must be (", rows_count, ",) of dtype ",
                      mean_in.scalar_type(), "; got ", grad->sizes(), " ", grad->scalar_type());
  }
  const Tensor mean = mean_in.contiguous(), variance = variance_in.contiguous();
  const Tensor wp = weight_phi_in.contiguous(), wv = weight_variance_in.contiguous(),
               wu = weight_second_in.contiguous();
  const Tensor ru = grad_mean_in.contiguous(), rk = grad_spread_in.contiguous();
  Tensor grad_mean = at::empty_like(mean), grad_variance = at::empty_like(mean);
  Tensor columns = at::empty({3, width}, mean.options().dtype(at::kDouble));
  by_dtype(mean, [&](auto zero) {
    using T = decltype(zero);
    Kernels<T>::tail_pass(kind, TAIL_BACKWARD, rows_count, width, mean.data_ptr<T>(), variance.data_ptr<T>(),
                          slope_for<T>(negative_slope), wp.data_ptr<T>(), wv.data_ptr<T>(), wu.data_ptr<T>(),
                          ru.data_ptr<T>(), rk.data_ptr<T>(), nullptr, 0.0, 0.0, 0.0, nullptr, nullptr,
                          grad_mean.data_ptr<T>(), grad_variance.data_ptr<T>(), columns.data_ptr<double>(), threads());
    return 0;
  });
  return {grad_mean, grad_variance, columns};
}

/* relu_tail and, from the same moments, relu_tail_backward's results for the Normal likelihood's row
   gradients at dL/d ELBO = 1 (u_r = scale beta residual_r, k_r = -scale beta / 2): the rows'
   residuals as normal_rows takes them. */
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> relu_tail_with_gradients(
    const Tensor& mean_in, const Tensor& variance_in, const Tensor& weight_phi_in, const Tensor& weight_variance_in,
    const Tensor& weight_second_in, const Tensor& y_in, const Tensor& loc, const Tensor& log_precision, double scale,
    bool bias, int64_t activation, double negative_slope) {
  check_tail("relu_tail_with_gradients", mean_in, variance_in,
             {&weight_phi_in, &weight_variance_in, &weight_second_in});
  const int kind = static_cast<int>(tail_kind("relu_tail_with_gradients", activation));
  const int64_t rows_count = mean_in.size(0), width = mean_in.size(1);
  check_floats("relu_tail_with_gradients", mean_in, {&y_in, &loc});
  check_numel("relu_tail_with_gradients", "y", y_in, rows_count);
  check_numel("relu_tail_with_gradients", "loc", loc, width + (bias ? 1 : 0));
  check_numel("relu_tail_with_gradients", "log_precision", log_precision, 1);
  const double beta = precision(log_precision).second;
  const double mean_bias = bias ? loc.reshape({-1})[width].item<double>() : 0.0;
  const Tensor mean = mean_in.contiguous(), variance = variance_in.contiguous(), y = y_in.contiguous();
  const Tensor wp = weight_phi_in.contiguous(), wv = weight_variance_in.contiguous(),
               wu = weight_second_in.contiguous();
  Tensor mean_sum = at::empty({rows_count}, mean.options()), spread_sum = at::empty({rows_count}, mean.options());
  Tensor grad_mean = at::empty_like(mean), grad_variance = at::empty_like(mean);
  Tensor columns = at::empty({3, width}, mean.options().dtype(at::kDouble));
  by_dtype(mean, [&](auto zero) {
    using T = decltype(zero);
    Kernels<T>::tail_pass(kind, TAIL_AHEAD, rows_count, width, mean.data_ptr<T>(), variance.data_ptr<T>(),
                          slope_for<T>(negative_slope), wp.data_ptr<T>(), wv.data_ptr<T>(), wu.data_ptr<T>(), nullptr,
                          nullptr, y.data_ptr<T>(), mean_bias, scale * beta, -0.5 * scale * beta,
                          mean_sum.data_ptr<T>(), spread_sum.data_ptr<T>(), grad_mean.data_ptr<T>(),
                          grad_variance.data_ptr<T>(), columns.data_ptr<double>(), threads());
    return 0;
  });
  return {mean_sum, spread_sum, grad_mean, grad_variance, columns};
}

// ------------------------------------------------------------------------- the moments' autograd

/* The activations' moments operators and their backward operators, through the dispatcher (not
   the functions above: under torch.compile or opcheck the tensors are fake, and the dispatcher
   sends them to the fake implementations). */
enum MomentsKind : int64_t {
  FAMILY_MOMENTS = 0,     // cfbnn::relu_family_moments
  PIECEWISE_MOMENTS = 4,  // the partials recomputed by the backward
  PIECEWISE_SAVING = 5    // the partials saved (cfbnn::piecewise_moments_partials): a gradient is wanted
};

/* A moments operator's arguments beyond (mean, spread) and the slope: the ReLU family's member and
   whether the spread is a variance; a piecewise polynomial's table, its breakpoint count and degree
   (alpha rides in the slope's slot: cfbnn::piecewise_moments). */
struct MomentsArguments {
  int64_t activation = 0;
  bool from_variance = false;
  Tensor table;
  int64_t breakpoints = 0, degree = 0;
  Tensor partials;  // the saved partial derivatives (PIECEWISE_SAVING), else empty
};

bool piecewise_kind(int64_t kind) { return kind == PIECEWISE_MOMENTS || kind == PIECEWISE_SAVING; }

using MomentsOutputs = std::tuple<Tensor, Tensor, Tensor>;
using Gradients = std::tuple<Tensor, Tensor>;

c10::OperatorHandle operator_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

MomentsOutputs call_moments(int64_t kind, const Tensor& mean, const Tensor& spread, double slope,
                            MomentsArguments& arguments) {
  if (kind == FAMILY_MOMENTS) {
    static const auto family = operator_handle("cfbnn::relu_family_moments")
                                   .typed<MomentsOutputs(const Tensor&, const Tensor&, int64_t, double, bool)>();
    return family.call(mean, spread, arguments.activation, slope, arguments.from_variance);
  }
  if (kind == PIECEWISE_MOMENTS) {
    static const auto engine =
        operator_handle("cfbnn::piecewise_moments")
            .typed<MomentsOutputs(const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t, double)>();
    return engine.call(mean, spread, arguments.table, arguments.breakpoints, arguments.degree, slope);
  }
  if (kind == PIECEWISE_SAVING) {
    static const auto saving =
        operator_handle("cfbnn::piecewise_moments_partials")
            .typed<std::tuple<Tensor, Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&, int64_t,
                                                              int64_t, double)>();
    auto [phi, ups, var, partials] =
        saving.call(mean, spread, arguments.table, arguments.breakpoints, arguments.degree, slope);
    // (undefined where the kernel saves none: decided by dtype and alpha, never by a size, which a
    // traced tensor may not have)
    if (saves_partials(mean, slope)) arguments.partials = partials;
    return {phi, ups, var};
  }
  TORCH_CHECK(false, "cfbnn: unknown moments kind ", kind);
}

Gradients call_moments_backward(int64_t kind, const Tensor& mean, const Tensor& spread, const Tensor& phi,
                                const Tensor& gp, const Tensor& gu, const Tensor& gv, double slope,
                                const MomentsArguments& arguments) {
  if (kind == FAMILY_MOMENTS) {
    static const auto family =
        operator_handle("cfbnn::relu_family_moments_backward")
            .typed<Gradients(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                             int64_t, double, bool)>();
    return family.call(mean, spread, phi, gp, gu, gv, arguments.activation, slope, arguments.from_variance);
  }
  if (piecewise_kind(kind)) {
    static const auto engine =
        operator_handle("cfbnn::piecewise_moments_backward")
            .typed<Gradients(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                             const Tensor&, int64_t, int64_t, double, const std::optional<Tensor>&)>();
    const bool saved = arguments.partials.defined();
    return engine.call(mean, spread, phi, gp, gu, gv, arguments.table, arguments.breakpoints, arguments.degree, slope,
                       saved ? std::optional<Tensor>(arguments.partials) : std::nullopt);
  }
  TORCH_CHECK(false, "cfbnn: unknown moments kind ", kind);
}

/* One autograd node per call: forward the moments operator, backward its backward operator. An
   output nothing used has no gradient (set_materialize_grads(false)): it goes in as one zero,
   expanded, which the kernels read as no gradient (gradient_operand), not as a block of zeros. A
   backward that builds a graph (create_graph, torch.func.grad) calls the backward operator
   through autograd, whose own derivative is registered in Python (cfbnn_cli/moments/
   operator_registration.py: differentiable_by_formula); otherwise straight to its kernel. One class
   for both families (the kind, the slope -- a piecewise polynomial's alpha -- and the other
   arguments ride in the context): each torch::autograd::Function instantiation costs seconds of
   compile time. A piecewise polynomial whose gradient will be taken runs
   cfbnn::piecewise_moments_partials instead, and its backward reads the saved partials. */
class MomentsAutograd : public torch::autograd::Function<MomentsAutograd> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const Tensor& mean,
                                                const Tensor& spread, int64_t kind, double slope,
                                                const std::optional<Tensor>& table, int64_t breakpoints,
                                                int64_t degree, int64_t activation, bool from_variance) {
    MomentsOutputs outputs;
    MomentsArguments arguments{activation, from_variance, table.value_or(Tensor()), breakpoints, degree, Tensor()};
    {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      outputs = call_moments(kind, mean, spread, slope, arguments);
    }
    auto& [phi, upsilon, variance] = outputs;
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({mean, spread, phi});
    ctx->saved_data["kind"] = kind;
    ctx->saved_data["slope"] = slope;
    ctx->saved_data["activation"] = activation;
    ctx->saved_data["from_variance"] = from_variance;
    if (piecewise_kind(kind)) {
      ctx->saved_data["table"] = arguments.table;
      ctx->saved_data["breakpoints"] = breakpoints;
      ctx->saved_data["degree"] = degree;
      // (none where nothing was saved: the backward operator then recomputes them)
      ctx->saved_data["saved_partials"] = arguments.partials.defined();
      if (arguments.partials.defined()) ctx->saved_data["partials"] = arguments.partials;
    }
    return {phi, upsilon, variance};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &mean = saved[0], &spread = saved[1], &phi = saved[2];
    const int64_t kind = ctx->saved_data["kind"].toInt();
    const double slope = ctx->saved_data["slope"].toDouble();
    MomentsArguments arguments;
    arguments.activation = ctx->saved_data["activation"].toInt();
    arguments.from_variance = ctx->saved_data["from_variance"].toBool();
    if (piecewise_kind(kind)) {
      arguments.table = ctx->saved_data["table"].toTensor();
      arguments.breakpoints = ctx->saved_data["breakpoints"].toInt();
      arguments.degree = ctx->saved_data["degree"].toInt();
      if (ctx->saved_data["saved_partials"].toBool()) arguments.partials = ctx->saved_data["partials"].toTensor();
    }
    for (Tensor& grad : grads) {
      if (!grad.defined()) grad = at::zeros({}, mean.options()).expand(mean.sizes());
    }
    Gradients result;
    if (at::GradMode::is_enabled()) {
      result = call_moments_backward(kind, mean, spread, phi, grads[0], grads[1], grads[2], slope, arguments);
    } else {
      at::AutoDispatchBelowADInplaceOrView below_autograd;
      result = call_moments_backward(kind, mean, spread, phi, grads[0], grads[1], grads[2], slope, arguments);
    }
    return {std::get<0>(result), std::get<1>(result), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(),
            Tensor()};
  }
};

// (an optional: an undefined tensor among a Function's inputs has no device, which apply reads)
const std::optional<Tensor> NO_TABLE = std::nullopt;

MomentsOutputs as_outputs(const torch::autograd::variable_list& outputs) {
  return {outputs[0], outputs[1], outputs[2]};
}

MomentsOutputs relu_family_moments_autograd(const Tensor& mean, const Tensor& spread, int64_t activation,
                                            double negative_slope, bool from_variance) {
  return as_outputs(
      MomentsAutograd::apply(mean, spread, FAMILY_MOMENTS, negative_slope, NO_TABLE, 0, 0, activation, from_variance));
}

MomentsOutputs piecewise_moments_autograd(const Tensor& mean, const Tensor& std_dev, const Tensor& table,
                                         int64_t breakpoints, int64_t degree, double alpha) {
  // the partials saved where a gradient will be taken (the engine's forward is the expensive pass:
  // saving them spares the backward a second one); cfbnn::piecewise_moments alone otherwise
  const bool wanted = at::GradMode::is_enabled() && (mean.requires_grad() || std_dev.requires_grad());
  const int64_t kind = wanted ? PIECEWISE_SAVING : PIECEWISE_MOMENTS;
  return as_outputs(MomentsAutograd::apply(mean, std_dev, kind, alpha, std::optional<Tensor>(table), breakpoints,
                                           degree, 0, false));
}

}  // namespace

/* A wrong build (a broken vector math library, say) must not be used: the ReLU kernel at known
   points (more than one block of them, so the padded path too) against the closed forms of paper
   eq. (20) computed here with std::erfc. Returns the largest relative error of Phi and Upsilon;
   cfbnn_cli/moments/kernel_library.py refuses a library whose error exceeds 1e-12. */
extern "C" double cfbnn_self_test(void) {
  const double cases[3][2] = {{-3.0, 1.0}, {0.0, 0.5}, {1.5, 2.0}};
  const int repeats = 40;
  const int64_t n = 3 * repeats;
  std::vector<double> mean(n), spread(n), phi(n), ups(n);
  for (int64_t i = 0; i < n; i++) {
    mean[i] = cases[i % 3][0];
    spread[i] = cases[i % 3][1];
  }
  std::vector<double> var(n);
  family_forward_f64(0, n, mean.data(), spread.data(), 0.0, phi.data(), ups.data(), var.data(), 1);
  double worst = 0.0;
  for (int64_t i = 0; i < n; i++) {
    const double m = mean[i], s = spread[i], t = m / s;
    const double cdf = 0.5 * std::erfc(-t / std::sqrt(2.0));
    const double pdf = std::exp(-0.5 * t * t) / std::sqrt(2.0 * M_PI);
    const double want_phi = m * cdf + s * pdf, want_ups = (m * m + s * s) * cdf + m * s * pdf;
    const double error = std::max(std::abs(phi[i] - want_phi) / std::abs(want_phi),
                                  std::abs(ups[i] - want_ups) / std::abs(want_ups));
    worst = std::isnan(error) ? INFINITY : std::max(worst, error);
  }
  return worst;
}

/* Registers the CPU kernels above for the cfbnn:: operators (defined in Python). A later
   registration for the same operator and key replaces an earlier one, so these take over from
   the Python CPU kernels that only load this library. Called once per process. */
extern "C" int cfbnn_register_cpu_kernels(void) {
  static torch::Library* library = nullptr;
  if (library != nullptr) return 0;
  library = new torch::Library(torch::Library::IMPL, "cfbnn", c10::DispatchKey::CPU, __FILE__, __LINE__);
  library->impl("relu_family_moments", TORCH_FN(relu_family_moments));
  library->impl("relu_family_moments_backward", TORCH_FN(relu_family_moments_backward));
  library->impl("relu_mean", TORCH_FN(relu_mean));
  library->impl("count_negative", TORCH_FN(count_negative));
  library->impl("piecewise_moments", TORCH_FN(piecewise_moments));
  library->impl("piecewise_moments_partials", TORCH_FN(piecewise_moments_partials));
  library->impl("piecewise_moments_backward", TORCH_FN(piecewise_moments_backward));
  library->impl("diagonal_kl", TORCH_FN(diagonal_kl));
  library->impl("diagonal_kl_backward", TORCH_FN(diagonal_kl_backward));
  library->impl("augment_pair", TORCH_FN(augment_pair));
  library->impl("outer_layers_pass", TORCH_FN(outer_layers_pass));
  library->impl("diagonal_kl_pass", TORCH_FN(diagonal_kl_pass));
  library->impl("normal_ell_rows", TORCH_FN(normal_ell_rows));
  library->impl("normal_elbo_rows", TORCH_FN(normal_elbo_rows));
  library->impl("normal_rows_backward", TORCH_FN(normal_rows_backward));
  library->impl("output_layer_gradients", TORCH_FN(output_layer_gradients));
  library->impl("finish_diagonal_gradients", TORCH_FN(finish_diagonal_gradients));
  library->impl("relu_tail", TORCH_FN(relu_tail));
  library->impl("relu_tail_backward", TORCH_FN(relu_tail_backward));
  library->impl("relu_tail_with_gradients", TORCH_FN(relu_tail_with_gradients));
  // AutogradCPU is more specific than the Autograd alias the Python registrations use: these
  // take the CPU's autograd; CUDA keeps the Python one (its backward launches Triton kernels)
  static torch::Library* autograd = new torch::Library(torch::Library::IMPL, "cfbnn", c10::DispatchKey::AutogradCPU,
                                                        __FILE__, __LINE__);
  autograd->impl("relu_family_moments", TORCH_FN(relu_family_moments_autograd));
  autograd->impl("piecewise_moments", TORCH_FN(piecewise_moments_autograd));
  return 1;
}
