// tidegate_linear::packed_linear(x, packed, bias): oneDNN's linear on a weight packed by
// packed_linear.py (mkldnn::_linear_pointwise), as an op defined in C++. Compiled graphs
// call it through the dispatcher at the cost of the oneDNN op itself; the same op defined in
// Python adds about 12 us a call, 48 calls in a decode step of the small model. Its fake
// (shape) implementation is registered from Python.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

namespace {

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x,
                                 packed,
                                 bias,
                                 std::string("none"),
                                 c10::List<std::optional<at::Scalar>>(),
                                 std::optional<std::string>(std::string(""))};
  op.callBoxed(stack);
  return stack[0].toTensor();
}

}  // namespace

TORCH_LIBRARY(tidegate_linear, m) {
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

// The packed weight is an opaque oneDNN tensor: its dispatch key is MkldnnCPU.
TORCH_LIBRARY_IMPL(tidegate_linear, CPU, m) { m.impl("packed_linear", &packed_linear); }
TORCH_LIBRARY_IMPL(tidegate_linear, MkldnnCPU, m) { m.impl("packed_linear", &packed_linear); }
