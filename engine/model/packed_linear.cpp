// tidegate_linear::packed_linear(x, packed, bias): oneDNN's linear on a weight packed by
// packed_linear.py (mkldnn::_linear_pointwise), as an op defined in C++. Compiled graphs
// call it through the dispatcher at the cost of the oneDNN op itself; the same op defined in
// Python adds about 12 us a call, 48 calls in a decode step of the small model. Its fake
// (shape) implementation is registered from Python.
//
// Row splits. For some shapes and row counts oneDNN's AMX matmul runs on one thread (a
// 512 x 2048 by 2048 x 768 product took as long with one thread as with two, and twice as
// long as two products of 256 rows). packed_linear.py measures, per weight shape, which row
// counts are faster in pieces and records them with set_row_split; the op then runs such a
// product as pieces of `piece` rows into one output.

#include <ATen/ATen.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace {

// (out features, in features) -> sorted (rows from, piece rows): from that row count up to
// the next entry's, products go in pieces of `piece` rows (0: whole).
using Plan = std::vector<std::pair<int64_t, int64_t>>;
std::mutex plans_mutex;
std::map<std::pair<int64_t, int64_t>, Plan> plans;

at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed,
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

int64_t piece_rows(int64_t out_features, int64_t in_features, int64_t rows) {
  std::lock_guard<std::mutex> guard(plans_mutex);
  auto found = plans.find({out_features, in_features});
  if (found == plans.end()) return 0;
  int64_t piece = 0;
  for (const auto& [from, size] : found->second) {
    if (rows < from) break;
    piece = size;
  }
  return piece;
}

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias) {
  const int64_t in_features = packed.size(1), out_features = packed.size(0);
  const int64_t rows = x.numel() / std::max<int64_t>(in_features, 1);
  const int64_t piece = piece_rows(out_features, in_features, rows);
  if (piece <= 0 || rows <= piece) return onednn_linear(x, packed, bias);
  const at::Tensor flat = x.reshape({rows, in_features});
  std::vector<at::Tensor> parts;
  for (int64_t start = 0; start < rows; start += piece) {
    parts.push_back(onednn_linear(flat.narrow(0, start, std::min(piece, rows - start)),
                                  packed, bias));
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out_features;
  return at::cat(parts, 0).view(shape);
}

// The plan of one weight shape: `from_rows` ascending, `piece_rows` beside it.
void set_row_split(int64_t out_features, int64_t in_features, std::vector<int64_t> from_rows,
                   std::vector<int64_t> pieces) {
  TORCH_CHECK(from_rows.size() == pieces.size(), "from_rows and piece_rows differ in length");
  Plan plan;
  for (size_t i = 0; i < from_rows.size(); ++i) {
    TORCH_CHECK(i == 0 || from_rows[i] > from_rows[i - 1], "from_rows must ascend");
    plan.emplace_back(from_rows[i], pieces[i]);
  }
  std::lock_guard<std::mutex> guard(plans_mutex);
  plans[{out_features, in_features}] = std::move(plan);
}

}  // namespace

TORCH_LIBRARY(tidegate_linear, m) {
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("set_row_split(int out_features, int in_features, int[] from_rows, int[] piece_rows) -> ()");
  m.impl("set_row_split", &set_row_split);
}

// The packed weight is an opaque oneDNN tensor: its dispatch key is MkldnnCPU.
TORCH_LIBRARY_IMPL(tidegate_linear, CPU, m) { m.impl("packed_linear", &packed_linear); }
TORCH_LIBRARY_IMPL(tidegate_linear, MkldnnCPU, m) { m.impl("packed_linear", &packed_linear); }
