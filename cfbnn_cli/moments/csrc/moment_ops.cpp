/* The activations' moments operators' CPU kernels (cfbnn_cli/moments/moment_ops.py declares the
 * operators, their reference kernels, Triton kernels, fakes, autograd and vmap rules): the ReLU
 * family's moments and their backward, ReLU's mean alone, the piecewise polynomials' moments and
 * their backward, and the argument checks' sign count. Each checks its operands, allocates its outputs and calls a
 * kernel of kernels.cpp; registered with torch's dispatcher for the CPU when the library is loaded
 * (TORCH_LIBRARY_IMPL below). */
#include "common.h"

namespace cfbnn {
namespace ops {
namespace {

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

const int64_t PW_MAX_BREAKPOINTS = kernels::MAX_BREAKPOINTS, PW_MAX_DEGREE = kernels::MAX_DEGREE;

/* The general engine's tables (cfbnn_cli/moments/piecewise_tables.py: coefficient_tables), read from
   the one float64 tensor cfbnn_cli/moments/moment_ops.py packs (bp, coef, deriv, side, tails,
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
        kernels::hs_forward_f32(n, m, s, t.B, t.D, t.bp, t.coef, t.deriv, t.side, t.tails, t.jumps, t.gl, t.coef32.data(),
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

/* (Phi, Upsilon, Var, partials): with `partials` (the operator's autograd sets it where a gradient
   will be taken) the four partial derivatives the backward reads, where the kernel saves them. */
std::tuple<Tensor, Tensor, Tensor, Tensor> piecewise_moments(const Tensor& mean, const Tensor& std_dev,
                                                             const Tensor& table, int64_t breakpoints,
                                                             int64_t degree, double alpha, bool partials) {
  return piecewise_forward("piecewise_moments", mean, std_dev, table, breakpoints, degree, alpha, partials);
}

/* From the saved partials where given (piecewise_moments', partials=True), else recomputed: the float32
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
              kernels::hs_backward_f32(n, m, s, t.B, t.D, t.bp, t.coef, t.deriv, t.side, t.tails, t.jumps, t.gl,
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

}  // namespace
}  // namespace ops
}  // namespace cfbnn

TORCH_LIBRARY_IMPL(cfbnn, CPU, m) {
  using namespace cfbnn::ops;
  m.impl("count_negative", TORCH_FN(count_negative));
  m.impl("relu_family_moments", TORCH_FN(relu_family_moments));
  m.impl("relu_family_moments_backward", TORCH_FN(relu_family_moments_backward));
  m.impl("relu_mean", TORCH_FN(relu_mean));
  m.impl("piecewise_moments", TORCH_FN(piecewise_moments));
  m.impl("piecewise_moments_backward", TORCH_FN(piecewise_moments_backward));
}

