// A sized program run in one C++ call (runtime/chain.py builds the plan).
//
// A listed size whose compiled pieces are all AOTInductor packages (torch's CPU container
// runner) and whose split ops are plain op calls needs no Python between its pieces: the
// chain holds the runners, the ops' dispatcher handles and the data flow between them as
// slot numbers, reads the call's tensors once, runs every step on C++ tensors and wraps
// only the graph's outputs. Python's way costs a generated forward, a wrapper per piece,
// a Python tensor per intermediate value and a Python op call per split op.
//
// Tensors of the call are read at the positions the plan names; every intermediate slot
// is cleared after its last reader, as the generated forward drops its names. Calls are
// independent (the slots live on the call's stack), so concurrent calls need no lock.
// The steps run with the GIL released, as torch's runner runs one package.
#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/inductor/aoti_runner/model_container_runner_cpu.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <optional>
#include <string>
#include <vector>

namespace py = pybind11;

namespace sizebackend {
namespace {

// One argument of an op step: a slot, a constant fixed at build time, or a scalar read
// from the call's arguments at a position (a SymInt the graph passes on).
struct OpArg {
  enum Kind { kSlot, kConstant, kCallArg } kind;
  int64_t index = -1;  // slot or call position
  c10::IValue constant;
  c10::TypePtr type;  // the schema's type of a call-position argument
};

struct Step {
  torch::inductor::AOTIModelContainerRunner* runner = nullptr;  // a package step
  std::optional<c10::OperatorHandle> op;                          // or an op step
  std::vector<int64_t> inputs;                                    // a package's slots
  std::vector<OpArg> args;                                        // an op's arguments
  std::vector<int64_t> outputs;  // slot per output (-1: dropped)
  std::vector<int64_t> release;  // slots read for the last time here
};

class Chain {
 public:
  Chain(int64_t num_slots, std::vector<std::pair<Py_ssize_t, int64_t>> inputs,
        const py::list& steps, std::vector<int64_t> result, bool result_tuple)
      : num_slots_(num_slots), inputs_(std::move(inputs)), result_(std::move(result)),
        result_tuple_(result_tuple) {
    for (const auto& item : steps) {
      // (kind, target, args, outputs, release)
      auto spec = item.cast<py::tuple>();
      Step step;
      auto kind = spec[0].cast<std::string>();
      if (kind == "package") {
        // spec[1]: the package (_torch/aoti.py's AlignedCpuPackage), held for the chain's
        // life: its constants live as long as it does, not as long as its runner.
        step.runner =
            spec[1].attr("runner").cast<torch::inductor::AOTIModelContainerRunnerCpu*>();
        step.inputs = spec[2].cast<std::vector<int64_t>>();
        keep_alive_.push_back(spec[1]);
      } else if (kind == "op") {
        auto name = spec[1].cast<std::pair<std::string, std::string>>();
        step.op = c10::Dispatcher::singleton().findSchemaOrThrow(name.first.c_str(),
                                                                 name.second.c_str());
        const auto& schema = step.op->schema();
        auto args = spec[2].cast<py::list>();
        TORCH_CHECK(args.size() == schema.arguments().size(), "chain: ", schema.name(),
                    " takes ", schema.arguments().size(), " arguments, the plan gives ",
                    args.size());
        for (size_t j = 0; j < args.size(); ++j) {
          auto arg = args[j].cast<py::tuple>();
          auto how = arg[0].cast<std::string>();
          OpArg a;
          if (how == "slot") {
            a.kind = OpArg::kSlot;
            a.index = arg[1].cast<int64_t>();
          } else if (how == "call") {
            a.kind = OpArg::kCallArg;
            a.index = arg[1].cast<int64_t>();
            a.type = schema.arguments()[j].type();
          } else {
            a.kind = OpArg::kConstant;
            a.constant = torch::jit::toIValue(arg[1], schema.arguments()[j].type());
          }
          step.args.push_back(std::move(a));
        }
        for (const auto& ret : schema.returns()) {
          TORCH_CHECK(ret.type()->kind() == c10::TypeKind::TensorType, "chain: ",
                      schema.name(), " returns a non-tensor");
        }
      } else {
        TORCH_CHECK(false, "chain: unknown step kind ", kind);
      }
      step.outputs = spec[3].cast<std::vector<int64_t>>();
      step.release = spec[4].cast<std::vector<int64_t>>();
      steps_.push_back(std::move(step));
    }
  }

  py::object call(const py::tuple& args) const {
    std::vector<at::Tensor> slots(num_slots_);
    for (const auto& [position, slot] : inputs_) {
      TORCH_CHECK(position < PyTuple_GET_SIZE(args.ptr()), "chain: called with ",
                  PyTuple_GET_SIZE(args.ptr()), " arguments");
      PyObject* obj = PyTuple_GET_ITEM(args.ptr(), position);
      TORCH_CHECK(THPVariable_Check(obj), "chain: argument ", position, " is not a tensor");
      slots[slot] = THPVariable_Unpack(obj);
    }
    // Scalars the ops read from the call, converted while the GIL is held.
    std::vector<c10::IValue> scalars;
    for (const auto& step : steps_) {
      for (const auto& a : step.args) {
        if (a.kind == OpArg::kCallArg) {
          TORCH_CHECK(a.index < PyTuple_GET_SIZE(args.ptr()), "chain: called with ",
                      PyTuple_GET_SIZE(args.ptr()), " arguments");
          scalars.push_back(
              torch::jit::toIValue(py::handle(PyTuple_GET_ITEM(args.ptr(), a.index)), a.type));
        }
      }
    }
    {
      // The steps run without the GIL, as torch's runner releases it for one package:
      // other Python threads (a background compile, a server's own) go on meanwhile.
      // An op with a Python kernel takes the GIL back itself (the dispatcher does).
      py::gil_scoped_release released;
      run_steps(slots, scalars);
    }
    if (!result_tuple_) {
      return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(slots[result_[0]])));
    }
    py::tuple out(result_.size());
    for (size_t i = 0; i < result_.size(); ++i) {
      PyObject* wrapped = THPVariable_Wrap(slots[result_[i]]);
      if (wrapped == nullptr) {
        throw py::error_already_set();
      }
      PyTuple_SET_ITEM(out.ptr(), i, wrapped);
    }
    return out;
  }

  int64_t size() const { return static_cast<int64_t>(steps_.size()); }

 private:
  void run_steps(std::vector<at::Tensor>& slots, std::vector<c10::IValue>& scalars) const {
    size_t next_scalar = 0;
    for (const auto& step : steps_) {
      if (step.runner != nullptr) {
        std::vector<at::Tensor> in;
        in.reserve(step.inputs.size());
        for (int64_t s : step.inputs) {
          in.push_back(slots[s]);
        }
        release(slots, step);
        auto out = step.runner->boxed_run(std::move(in));
        store(slots, step, out);
      } else {
        torch::jit::Stack stack;
        stack.reserve(step.args.size());
        for (const auto& a : step.args) {
          switch (a.kind) {
            case OpArg::kSlot:
              stack.emplace_back(slots[a.index]);
              break;
            case OpArg::kConstant:
              stack.push_back(a.constant);
              break;
            case OpArg::kCallArg:
              stack.push_back(std::move(scalars[next_scalar++]));
              break;
          }
        }
        release(slots, step);
        step.op->callBoxed(stack);
        std::vector<at::Tensor> out;
        out.reserve(stack.size());
        for (auto& v : stack) {
          out.push_back(std::move(v).toTensor());
        }
        store(slots, step, out);
      }
    }
  }

  static void release(std::vector<at::Tensor>& slots, const Step& step) {
    for (int64_t s : step.release) {
      slots[s].reset();
    }
  }

  static void store(std::vector<at::Tensor>& slots, const Step& step,
                    std::vector<at::Tensor>& out) {
    TORCH_CHECK(out.size() == step.outputs.size(), "chain: a step returned ", out.size(),
                " tensors, the plan expects ", step.outputs.size());
    for (size_t i = 0; i < out.size(); ++i) {
      if (step.outputs[i] >= 0) {
        slots[step.outputs[i]] = std::move(out[i]);
      }
    }
  }

  int64_t num_slots_;
  std::vector<std::pair<Py_ssize_t, int64_t>> inputs_;
  std::vector<Step> steps_;
  std::vector<int64_t> result_;
  bool result_tuple_;
  std::vector<py::object> keep_alive_;  // the packages that own the runners
};

}  // namespace

void bind_chain(py::module_& m) {
  py::class_<Chain>(m, "Chain")
      .def(py::init<int64_t, std::vector<std::pair<Py_ssize_t, int64_t>>, const py::list&,
                    std::vector<int64_t>, bool>(),
           py::arg("num_slots"), py::arg("inputs"), py::arg("steps"), py::arg("result"),
           py::arg("result_tuple"))
      .def("__call__", &Chain::call, py::arg("args"))
      .def("__len__", &Chain::size);
}

}  // namespace sizebackend
