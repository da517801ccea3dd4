// `OpProgram`: a recorded sequence of dispatcher calls, replayed in one native call (worker_proc.runtime.step_replay
// records it and decides when it may run). Rules that hold:
// - every argument of a call is fixed at recording except the tensors that name a register: a register is
//   one of the program's inputs or a tensor an earlier call of the program returned;
// - a call's returns, flattened (a tensor list gives one register per element), fill the registers the
//   recording named, in order; a return that is not a tensor refuses the recording;
// - a run holds its registers only while it runs: what it returns are the registers the caller asks for.
#include <torch/custom_class.h>
#include <torch/library.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ScalarOps.h>
#include <c10/core/InferenceMode.h>

#include <array>
#include <string>
#include <vector>

namespace hyssm_cpu {
namespace {

// How the recording encodes one argument; the values it takes are read from the typed lists in order.
enum Kind : int64_t {
  kNone = 0,
  kTensor = 1,      // a fixed tensor (tensors)
  kRegister = 2,    // a register (ints)
  kInt = 3,         // ints
  kFloat = 4,       // floats
  kBool = 5,        // ints
  kIntList = 6,     // ints: count, then the values
  kFloatList = 7,   // ints: count; floats: the values
  kTensorList = 8,  // ints: optional (0/1), count, then per element a kind (0, 1, 2) and a register (or 0)
  kString = 9,      // strs
  kDevice = 10,     // strs
  kDtype = 11,      // strs: the dtype's name
  kBoolList = 12,   // ints: count, then the values
  kNumber = 13,     // floats: a Python number where the schema takes a tensor (made a wrapped number)
  kIntNumber = 14,  // ints: the same for an integer
};

at::Tensor wrapped(const c10::Scalar& s) {
  at::Tensor t = c10::scalar_to_tensor(s);
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

c10::ScalarType dtype_named(const std::string& name) {
  static const std::array<std::pair<const char*, c10::ScalarType>, 10> names{{
      {"float32", c10::kFloat}, {"float64", c10::kDouble}, {"bfloat16", c10::kBFloat16},
      {"float16", c10::kHalf}, {"int64", c10::kLong}, {"int32", c10::kInt}, {"int16", c10::kShort},
      {"int8", c10::kChar}, {"uint8", c10::kByte}, {"bool", c10::kBool}}};
  for (const auto& [n, t] : names)
    if (name == n) return t;
  TORCH_CHECK(false, "OpProgram: unknown dtype ", name);
}

struct Call {
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;
  std::vector<std::array<int64_t, 3>> registers;  // (argument, list element or -1, register)
  std::vector<int64_t> outs;
};

class Reader {
 public:
  Reader(const std::vector<int64_t>& ints, const std::vector<double>& floats, const std::vector<std::string>& strs,
         const std::vector<at::Tensor>& tensors)
      : ints_(ints), floats_(floats), strs_(strs), tensors_(tensors) {}
  int64_t i() { return at(ints_, ni_++); }
  double f() { return at(floats_, nf_++); }
  const std::string& s() { return at(strs_, ns_++); }
  const at::Tensor& t() { return at(tensors_, nt_++); }
  bool done() const {
    return ni_ == ints_.size() && nf_ == floats_.size() && ns_ == strs_.size() && nt_ == tensors_.size();
  }

 private:
  template <typename T>
  static const T& at(const std::vector<T>& v, size_t n) {
    TORCH_CHECK(n < v.size(), "OpProgram: an argument encoding ran past its values");
    return v[n];
  }
  const std::vector<int64_t>& ints_;
  const std::vector<double>& floats_;
  const std::vector<std::string>& strs_;
  const std::vector<at::Tensor>& tensors_;
  size_t ni_ = 0, nf_ = 0, ns_ = 0, nt_ = 0;
};

// One argument, decoded; the registers it names go to `registers` (with argument index `arg`).
c10::IValue decode(int64_t kind, Reader& in, int64_t arg, std::vector<std::array<int64_t, 3>>& registers) {
  switch (kind) {
    case kNone: return c10::IValue();
    case kTensor: return in.t();
    case kRegister: registers.push_back({arg, -1, in.i()}); return at::Tensor();
    case kInt: return in.i();
    case kFloat: return in.f();
    case kBool: return in.i() != 0;
    case kIntList: {
      std::vector<int64_t> v(in.i());
      for (auto& x : v) x = in.i();
      return v;
    }
    case kBoolList: {
      c10::List<bool> v;
      for (int64_t n = in.i(); n > 0; --n) v.push_back(in.i() != 0);
      return v;
    }
    case kFloatList: {
      std::vector<double> v(in.i());
      for (auto& x : v) x = in.f();
      return v;
    }
    case kTensorList: {
      const bool optional = in.i() != 0;
      const int64_t n = in.i();
      c10::List<c10::optional<at::Tensor>> opt;
      c10::List<at::Tensor> plain;
      for (int64_t e = 0; e < n; ++e) {
        const int64_t element = in.i(), reg = in.i();
        at::Tensor t;
        if (element == kTensor) t = in.t();
        if (element == kRegister) registers.push_back({arg, e, reg});
        TORCH_CHECK(optional || element != kNone, "OpProgram: None in a list of tensors");
        if (optional) {
          opt.push_back(element == kNone ? c10::optional<at::Tensor>() : c10::optional<at::Tensor>(t));
        } else {
          plain.push_back(t);
        }
      }
      return optional ? c10::IValue(opt) : c10::IValue(plain);
    }
    case kNumber: return wrapped(in.f());
    case kIntNumber: return wrapped(in.i());
    case kString: return in.s();
    case kDevice: return c10::Device(in.s());
    case kDtype: return static_cast<int64_t>(dtype_named(in.s()));
    default: TORCH_CHECK(false, "OpProgram: unknown argument kind ", kind);
  }
}

// A list decoded as ints, floats or bools, as the list type the schema names (e.g. Scalar?[]: an empty list
// has no element type of its own).
c10::IValue as_schema_list(c10::IValue value, const c10::TypePtr& type) {
  if (!value.isIntList() && !value.isDoubleList() && !value.isBoolList()) return value;
  const c10::TypePtr* inner = &type;
  c10::TypePtr unwrapped;
  if (const auto* opt = type->castRaw<c10::OptionalType>()) {
    unwrapped = opt->getElementType();
    inner = &unwrapped;
  }
  const auto* list_type = (*inner)->castRaw<c10::ListType>();
  if (list_type == nullptr) return value;
  const c10::TypePtr& element = list_type->getElementType();
  const auto kind = element->kind();
  if (kind == c10::TypeKind::IntType || kind == c10::TypeKind::FloatType || kind == c10::TypeKind::BoolType)
    return value;
  c10::impl::GenericList out(element);
  for (const c10::IValue& v : value.toListRef()) out.push_back(v);
  return out;
}

// Whether an argument of `type` is a Scalar or Scalar? (which a bool is passed as, though bool is not a number
// type of the schema's).
bool takes_scalar(const c10::TypePtr& type) {
  if (const auto* opt = type->castRaw<c10::OptionalType>()) return opt->getElementType()->kind() == c10::TypeKind::NumberType;
  return type->kind() == c10::TypeKind::NumberType;
}

// Puts register tensor `t` into a call's argument; a list is copied first, so that the recorded list keeps
// its placeholders and holds no tensor of a run past that run.
void set_register(c10::IValue& value, int64_t element, const at::Tensor& t) {
  if (element < 0) {
    value = t;
  } else if (value.isTensorList()) {
    c10::List<at::Tensor> list = value.toTensorList().copy();
    list.set(element, t);
    value = list;
  } else {
    c10::List<c10::optional<at::Tensor>> list = value.toOptionalTensorList().copy();
    list.set(element, c10::optional<at::Tensor>(t));
    value = list;
  }
}

class OpProgram : public torch::CustomClassHolder {
 public:
  explicit OpProgram(int64_t inputs) : inputs_(inputs), registers_(inputs) {}

  // Appends one call of `name`.`overload`; `kinds` holds one kind per schema argument, in order.
  void add(const std::string& name, const std::string& overload, const std::vector<int64_t>& kinds,
           const std::vector<int64_t>& ints, const std::vector<double>& floats, const std::vector<std::string>& strs,
           const std::vector<at::Tensor>& tensors, const std::vector<int64_t>& outs) {
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    TORCH_CHECK(kinds.size() == op.schema().arguments().size(), "OpProgram: ", name, " takes ",
                op.schema().arguments().size(), " arguments, ", kinds.size(), " given");
    Call call{op, {}, {}, outs};
    Reader in(ints, floats, strs, tensors);
    const auto& arguments = op.schema().arguments();
    for (size_t a = 0; a < kinds.size(); ++a) {
      c10::IValue v = as_schema_list(decode(kinds[a], in, a, call.registers), arguments[a].type());
      const bool placeholder = v.isTensor() && !v.toTensor().defined();  // a register: a tensor when run
      const bool bool_scalar = v.isBool() && takes_scalar(arguments[a].type());  // the kernel reads it as a Scalar
      TORCH_CHECK(placeholder || bool_scalar || v.type()->isSubtypeOf(*arguments[a].type()), "OpProgram: ", name, ": argument ",
                  arguments[a].name(), " is ", v.type()->str(), ", the schema takes ", arguments[a].type()->str());
      call.args.push_back(std::move(v));
    }
    TORCH_CHECK(in.done(), "OpProgram: ", name, ": values left over after its arguments");
    for (const auto& r : call.registers)
      TORCH_CHECK(r[2] >= 0 && r[2] < registers_, "OpProgram: ", name, " reads register ", r[2], " before it is set");
    for (size_t k = 0; k < outs.size(); ++k)
      TORCH_CHECK(outs[k] == registers_ + static_cast<int64_t>(k), "OpProgram: returns fill the next registers");
    registers_ += static_cast<int64_t>(outs.size());
    calls_.push_back(std::move(call));
  }

  std::vector<at::Tensor> run(const std::vector<at::Tensor>& inputs, const std::vector<int64_t>& wanted) {
    TORCH_CHECK(static_cast<int64_t>(inputs.size()) == inputs_, "OpProgram: ", inputs_, " inputs expected");
    c10::InferenceMode guard;
    std::vector<at::Tensor> regs(registers_);
    for (int64_t i = 0; i < inputs_; ++i) regs[i] = inputs[i];
    std::vector<c10::IValue> stack;
    for (const Call& call : calls_) {
      stack.assign(call.args.begin(), call.args.end());
      for (const auto& r : call.registers) set_register(stack[r[0]], r[1], regs[r[2]]);
      call.op.callBoxed(&stack);
      size_t out = 0;
      for (const c10::IValue& v : stack) {
        if (v.isTensor()) {
          regs[call.outs.at(out++)] = v.toTensor();
        } else if (v.isTensorList()) {
          for (const at::Tensor& t : v.toTensorList()) regs[call.outs.at(out++)] = t;
        } else {
          TORCH_CHECK(false, "OpProgram: a call returned something other than tensors");
        }
      }
      TORCH_CHECK(out == call.outs.size(), "OpProgram: a call returned ", out, " tensors, ", call.outs.size(),
                  " recorded");
    }
    std::vector<at::Tensor> result;
    for (int64_t w : wanted) result.push_back(regs.at(w));
    return result;
  }

  int64_t size() const { return static_cast<int64_t>(calls_.size()); }

 private:
  int64_t inputs_, registers_;
  std::vector<Call> calls_;
};

}  // namespace
}  // namespace hyssm_cpu

TORCH_LIBRARY_FRAGMENT(hyssm_cpu, m) {
  m.class_<hyssm_cpu::OpProgram>("OpProgram")
      .def(torch::init<int64_t>())
      .def("add", &hyssm_cpu::OpProgram::add)
      .def("run", &hyssm_cpu::OpProgram::run)
      .def("size", &hyssm_cpu::OpProgram::size);
}
