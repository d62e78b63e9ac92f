/* The activations' moments operators' CPU kernels (cfbnn_cli/moments/moment_ops.py declares the
 * operators, their reference kernels, Triton kernels, fakes, autograd and vmap rules): the ReLU
 * family's moments and their backward, ReLU's mean alone, the piecewise polynomials' moments, and
 * the argument checks' sign count. Each checks its operands, allocates its outputs and calls a
 * kernel of kernels.cpp; registered with torch's dispatcher for the CPU when the library is loaded
 * (TORCH_LIBRARY_IMPL below). */
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>

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
}  // namespace ops
}  // namespace cfbnn

TORCH_LIBRARY_IMPL(cfbnn, CPU, m) {
  using namespace cfbnn::ops;
  m.impl("count_negative", TORCH_FN(count_negative));
  m.impl("relu_family_moments", TORCH_FN(relu_family_moments));
  m.impl("relu_family_moments_backward", TORCH_FN(relu_family_moments_backward));
  m.impl("relu_mean", TORCH_FN(relu_mean));
  m.impl("piecewise_moments", TORCH_FN(piecewise_moments));
  m.impl("piecewise_moments_partials", TORCH_FN(piecewise_moments_partials));
  m.impl("piecewise_moments_backward", TORCH_FN(piecewise_moments_backward));
}

// AutogradCPU is more specific than the Autograd alias the Python registrations use: these take the
// CPU's autograd; CUDA keeps the Python one (its backward launches Triton kernels)
TORCH_LIBRARY_IMPL(cfbnn, AutogradCPU, m) {
  using namespace cfbnn::ops;
  m.impl("relu_family_moments", TORCH_FN(relu_family_moments_autograd));
  m.impl("piecewise_moments", TORCH_FN(piecewise_moments_autograd));
}
