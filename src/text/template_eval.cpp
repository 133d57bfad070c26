#include "text/template_eval.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "text/template_builtins.h"

namespace rf::text::detail {

// One frame of names: the template's top level, a for loop, a macro call, a `{% set %}` block.
struct Scope {
  std::shared_ptr<Scope> parent;
  std::vector<std::pair<std::string, Value>> vars;

  const Value* find(const std::string& name) const {
    for (const Scope* s = this; s; s = s->parent.get())
      for (const auto& [n, v] : s->vars)
        if (n == name) return &v;
    return nullptr;
  }
  void set(const std::string& name, Value v) {
    for (auto& [n, old] : vars)
      if (n == name) {
        old = std::move(v);
        return;
      }
    vars.emplace_back(name, std::move(v));
  }
};

namespace {

enum class Flow { Normal, Break, Continue };

using ScopePtr = std::shared_ptr<Scope>;

[[noreturn]] void fail(const std::string& why) { throw RenderFailure(why); }

int64_t int_of(const Value& v) { return v.kind == Kind::Bool ? v.b : v.i; }
double double_of(const Value& v) { return v.kind == Kind::Float ? v.f : static_cast<double>(int_of(v)); }

[[noreturn]] void bad_operands(const std::string& op, const Value& a, const Value& b) {
  if (a.is_undefined()) fail_undefined(a);
  if (b.is_undefined()) fail_undefined(b);
  fail("unsupported operand type(s) for " + op + ": '" + type_name(a) + "' and '" + type_name(b) + "'");
}

// a OP b on Python ints, refused where a 64-bit result would overflow (Python's ints would grow instead).
template <typename Op>
Value checked(Op op, int64_t a, int64_t b) {
  int64_t r = 0;
  if (op(a, b, &r)) fail("integer arithmetic beyond 64 bits is not supported");
  return Value::integer(r);
}
constexpr auto kAdd = [](int64_t a, int64_t b, int64_t* r) { return __builtin_add_overflow(a, b, r); };
constexpr auto kSub = [](int64_t a, int64_t b, int64_t* r) { return __builtin_sub_overflow(a, b, r); };
constexpr auto kMul = [](int64_t a, int64_t b, int64_t* r) { return __builtin_mul_overflow(a, b, r); };

// Python's float // and % (the sign of the result follows the divisor).
std::pair<double, double> py_divmod(double a, double b) {
  if (b == 0.0) fail("float division by zero");
  double mod = std::fmod(a, b);
  double div = (a - mod) / b;
  if (mod != 0.0) {
    if ((b < 0) != (mod < 0)) {
      mod += b;
      div -= 1.0;
    }
  } else {
    mod = std::copysign(0.0, b);
  }
  double floordiv;
  if (div != 0.0) {
    floordiv = std::floor(div);
    if (div - floordiv > 0.5) floordiv += 1.0;
  } else {
    floordiv = std::copysign(0.0, a / b);
  }
  return {floordiv, mod};
}

Value repeat(const Value& seq, int64_t times) {
  if (seq.kind == Kind::String) {
    std::string out;
    for (int64_t k = 0; k < times; ++k) out += seq.str;
    return Value::string(out);
  }
  Items out;
  for (int64_t k = 0; k < times; ++k) out.insert(out.end(), seq.list->begin(), seq.list->end());
  return Value::list_of(std::move(out), seq.kind);
}

// printf-style `str % args` for the conversions templates use (%s %r %d %i %%).
Value format_percent(const std::string& fmt, const Value& args) {
  Items values = args.kind == Kind::Tuple ? *args.list : Items{args};
  size_t next = 0;
  std::string out;
  for (size_t k = 0; k < fmt.size(); ++k) {
    if (fmt[k] != '%') {
      out += fmt[k];
      continue;
    }
    if (k + 1 >= fmt.size()) fail("incomplete format");
    char c = fmt[++k];
    if (c == '%') {
      out += '%';
      continue;
    }
    if (next >= values.size()) fail("not enough arguments for format string");
    const Value& v = values[next++];
    if (c == 's') {
      out += to_str(v);
    } else if (c == 'r') {
      out += repr(v);
    } else if (c == 'd' || c == 'i') {
      if (!v.is_number()) fail("%" + std::string(1, c) + " format: a real number is required, not " + type_name(v));
      out += std::to_string(v.kind == Kind::Float ? static_cast<int64_t>(std::trunc(v.f)) : int_of(v));
    } else {
      fail(std::string("the format conversion %") + c + " is not supported");
    }
  }
  if (next < values.size()) fail("not all arguments converted during string formatting");
  return Value::string(out);
}

Value arithmetic(const std::string& op, const Value& a, const Value& b) {
  const bool nums = a.is_number() && b.is_number();
  const bool floats = nums && (a.kind == Kind::Float || b.kind == Kind::Float);
  if (op == "+") {
    if (nums) return floats ? Value::real(double_of(a) + double_of(b)) : checked(kAdd, int_of(a), int_of(b));
    if (a.kind == Kind::String && b.kind == Kind::String) return Value::string(a.str + b.str);
    if (a.is_sequence_like() && a.kind == b.kind) {
      Items out = *a.list;
      out.insert(out.end(), b.list->begin(), b.list->end());
      return Value::list_of(std::move(out), a.kind);
    }
    if (a.kind == Kind::String && !b.is_undefined() && !a.is_undefined())
      fail("can only concatenate str (not \"" + type_name(b) + "\") to str");
    bad_operands(op, a, b);
  }
  if (op == "-") {
    if (!nums) bad_operands(op, a, b);
    return floats ? Value::real(double_of(a) - double_of(b)) : checked(kSub, int_of(a), int_of(b));
  }
  if (op == "*") {
    if (nums) return floats ? Value::real(double_of(a) * double_of(b)) : checked(kMul, int_of(a), int_of(b));
    const bool a_seq = a.kind == Kind::String || a.is_sequence_like();
    const bool b_seq = b.kind == Kind::String || b.is_sequence_like();
    if (a_seq && (b.kind == Kind::Int || b.kind == Kind::Bool)) return repeat(a, int_of(b));
    if (b_seq && (a.kind == Kind::Int || a.kind == Kind::Bool)) return repeat(b, int_of(a));
    bad_operands(op, a, b);
  }
  if (op == "/") {
    if (!nums) bad_operands(op, a, b);
    if (double_of(b) == 0.0) fail("division by zero");
    return Value::real(double_of(a) / double_of(b));
  }
  if (op == "//" || op == "%") {
    if (op == "%" && a.kind == Kind::String) return format_percent(a.str, b);
    if (!nums) bad_operands(op, a, b);
    if (floats) {
      auto [div, mod] = py_divmod(double_of(a), double_of(b));
      return Value::real(op == "//" ? div : mod);
    }
    const int64_t x = int_of(a), y = int_of(b);
    if (y == 0) fail("integer division or modulo by zero");
    if (x == INT64_MIN && y == -1) fail("integer arithmetic beyond 64 bits is not supported");
    int64_t q = x / y, m = x % y;
    if (m != 0 && ((m < 0) != (y < 0))) {
      q -= 1;
      m += y;
    }
    return Value::integer(op == "//" ? q : m);
  }
  if (op == "**") {
    if (!nums) bad_operands(op, a, b);
    if (!floats && int_of(b) >= 0) {
      int64_t base = int_of(a), result = 1;
      for (int64_t e = int_of(b); e > 0; --e)
        if (__builtin_mul_overflow(result, base, &result)) fail("integer arithmetic beyond 64 bits is not supported");
      return Value::integer(result);
    }
    if (double_of(a) == 0.0 && double_of(b) < 0) fail("0.0 cannot be raised to a negative power");
    return Value::real(std::pow(double_of(a), double_of(b)));
  }
  fail("unknown operator " + op);
}

class Evaluator {
 public:
  Evaluator(const Program& program, const RenderLimits& limits) : prog_(program), limits_(limits) {}

  Rendered run(const nlohmann::ordered_json& variables) {
    auto globals = std::make_shared<Scope>();
    if (!variables.is_null()) {
      if (!variables.is_object()) throw Error(prog_.origin + ": the template's variables must be a JSON object");
      try {
        for (const auto& [k, v] : variables.items()) globals->set(k, from_json(v));
      } catch (const RenderFailure& f) {
        throw Error(prog_.origin + ": " + f.what());
      }
    }
    auto top = std::make_shared<Scope>();
    top->parent = globals;
    Rendered result;
    top_ = &result.text;
    spans_ = &result.generation;
    exec(prog_.body, top, result.text);
    return result;
  }

 private:
  std::string where(Pos p) const {
    return prog_.origin + ":" + std::to_string(p.line) + ":" + std::to_string(p.col) + ": ";
  }

  void emit(std::string& out, const std::string& text) {
    if (out.size() + text.size() > limits_.max_output_bytes)
      fail("the render exceeds " + std::to_string(limits_.max_output_bytes) + " bytes (RenderLimits)");
    out += text;
  }

  Flow exec(const Body& body, const ScopePtr& scope, std::string& out) {
    for (const StmtPtr& s : body) {
      Flow f = Flow::Normal;
      try {
        f = exec_one(*s, scope, out);
      } catch (const RenderFailure& e) {
        throw Error(where(s->pos) + e.what());
      }
      if (f != Flow::Normal) return f;
    }
    return Flow::Normal;
  }

  Flow exec_one(const Stmt& s, const ScopePtr& scope, std::string& out) {
    switch (s.kind) {
      case StmtKind::Text:
        emit(out, s.text);
        return Flow::Normal;
      case StmtKind::Print:
        emit(out, to_str(eval(*s.expr, scope)));
        return Flow::Normal;
      case StmtKind::If:
        for (size_t k = 0; k < s.conds.size(); ++k)
          if (truthy(eval(*s.conds[k], scope))) return exec(s.bodies[k], scope, out);
        if (s.bodies.size() > s.conds.size()) return exec(s.bodies.back(), scope, out);
        return Flow::Normal;
      case StmtKind::For:
        exec_for(s, scope, out);
        return Flow::Normal;
      case StmtKind::Set:
        assign(s, eval(*s.expr, scope), scope);
        return Flow::Normal;
      case StmtKind::SetBlock: {
        auto inner = std::make_shared<Scope>();
        inner->parent = scope;
        std::string captured;
        exec(s.body, inner, captured);
        Value v = Value::string(std::move(captured));
        if (s.expr) v = apply_chain(*s.expr, v, scope);
        assign(s, std::move(v), scope);
        return Flow::Normal;
      }
      case StmtKind::Macro: {
        Value m = Value::make(Kind::Macro);
        auto ref = std::make_shared<MacroRef>();
        for (const auto& node : prog_.macros)
          if (node->stmt == &s) ref->node = node.get();
        ref->scope = scope;
        if (defining_scopes_.empty() || defining_scopes_.back() != scope) defining_scopes_.push_back(scope);
        m.macro = std::move(ref);
        scope->set(s.text, std::move(m));
        return Flow::Normal;
      }
      case StmtKind::Break:
        return Flow::Break;
      case StmtKind::Continue:
        return Flow::Continue;
      case StmtKind::Generation: {
        // transformers' AssistantTracker renders the body as a caller() in a scope of its own.
        auto inner = std::make_shared<Scope>();
        inner->parent = scope;
        std::string body;
        exec(s.body, inner, body);
        if (&out == top_) spans_->push_back({out.size(), out.size() + body.size()});
        emit(out, body);
        return Flow::Normal;
      }
    }
    return Flow::Normal;
  }

  void unpack(const std::vector<std::string>& targets, const Value& v, Scope& scope) {
    if (targets.size() == 1) {
      scope.set(targets[0], v);
      return;
    }
    Items items = iterate(v);
    if (items.size() != targets.size())
      fail(items.size() > targets.size() ? "too many values to unpack (expected " + std::to_string(targets.size()) + ")"
                                         : "not enough values to unpack (expected " + std::to_string(targets.size()) +
                                               ", got " + std::to_string(items.size()) + ")");
    for (size_t k = 0; k < targets.size(); ++k) scope.set(targets[k], items[k]);
  }

  void assign(const Stmt& s, Value v, const ScopePtr& scope) {
    if (s.attr.empty()) {
      unpack(s.targets, v, *scope);
      return;
    }
    const Value* ns = scope->find(s.targets[0]);
    if (!ns || ns->kind != Kind::Namespace) fail("cannot assign attribute on non-namespace object");
    if (!s.attr.empty() && s.attr[0] == '_')
      fail("Chat templates cannot store underscore-prefixed attributes on a namespace, but got '" + s.attr +
           "'. Please rename the attribute.");
    ns->dict->set(Value::string(s.attr), std::move(v));
  }

  void count_iteration() {
    if (++iterations_ > limits_.max_loop_iterations)
      fail("the render runs more than " + std::to_string(limits_.max_loop_iterations) +
           " loop iterations (RenderLimits)");
  }

  void exec_for(const Stmt& s, const ScopePtr& scope, std::string& out) {
    Items items = iterate(eval(*s.expr, scope));
    auto loop_scope = std::make_shared<Scope>();
    loop_scope->parent = scope;
    if (s.cond) {
      Items kept;
      for (const Value& item : items) {
        count_iteration();
        unpack(s.targets, item, *loop_scope);
        if (truthy(eval(*s.cond, loop_scope))) kept.push_back(item);
      }
      items = std::move(kept);
    }
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < n; ++k) {
      count_iteration();
      unpack(s.targets, items[static_cast<size_t>(k)], *loop_scope);
      Mapping loop;
      auto put = [&](const char* key, Value v) { loop.items.emplace_back(Value::string(key), std::move(v)); };
      put("index0", Value::integer(k));
      put("index", Value::integer(k + 1));
      put("revindex0", Value::integer(n - k - 1));
      put("revindex", Value::integer(n - k));
      put("first", Value::boolean(k == 0));
      put("last", Value::boolean(k == n - 1));
      put("length", Value::integer(n));
      put("depth", Value::integer(1));
      put("depth0", Value::integer(0));
      put("previtem", k > 0 ? items[static_cast<size_t>(k - 1)] : Value::undefined("there is no previous item"));
      put("nextitem", k + 1 < n ? items[static_cast<size_t>(k + 1)] : Value::undefined("there is no next item"));
      loop_scope->set("loop", Value::dict_of(std::move(loop), Kind::Loop));
      if (exec(s.body, loop_scope, out) == Flow::Break) break;
    }
    if (n == 0) exec(s.else_body, loop_scope, out);
  }

  Value eval(const Expr& e, const ScopePtr& scope) {
    try {
      return eval_inner(e, scope);
    } catch (const RenderFailure& f) {
      throw Error(where(e.pos) + f.what());
    }
  }

  CallArgs eval_args(const Expr& e, size_t first, const ScopePtr& scope) {
    CallArgs a;
    for (size_t k = first; k < e.args.size(); ++k) a.pos.push_back(eval(*e.args[k], scope));
    for (const auto& [key, x] : e.kwargs) a.kw.emplace_back(key, eval(*x, scope));
    return a;
  }

  // A `{% set x | f | g %}` block's filters applied to its captured text (the innermost operand left null).
  Value apply_chain(const Expr& f, const Value& v, const ScopePtr& scope) {
    Value base = f.args[0] ? apply_chain(*f.args[0], v, scope) : v;
    return apply_filter(f.name, base, eval_args(f, 1, scope));
  }

  Value eval_inner(const Expr& e, const ScopePtr& scope) {
    switch (e.kind) {
      case ExprKind::Const:
        return e.value;
      case ExprKind::Name: {
        if (const Value* v = scope->find(e.name)) return *v;
        if (is_global_function(e.name)) return Value::function(e.name);
        return Value::undefined("'" + e.name + "' is undefined");
      }
      case ExprKind::List:
      case ExprKind::Tuple: {
        Items items;
        for (const auto& x : e.args) items.push_back(eval(*x, scope));
        return Value::list_of(std::move(items), e.kind == ExprKind::List ? Kind::List : Kind::Tuple);
      }
      case ExprKind::Dict: {
        Mapping d;
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) d.set(eval(*e.args[k], scope), eval(*e.args[k + 1], scope));
        return Value::dict_of(std::move(d));
      }
      case ExprKind::Getattr:
        return get_attribute(eval(*e.args[0], scope), e.name);
      case ExprKind::Getitem: {
        Value obj = eval(*e.args[0], scope);
        const Expr& sub = *e.args[1];
        if (sub.kind == ExprKind::Slice) {
          Items parts;
          for (const auto& x : sub.args) parts.push_back(x ? eval(*x, scope) : Value::none());
          Value slice = Value::list_of(std::move(parts), Kind::Tuple);
          slice.str = "slice";
          if (obj.is_undefined()) fail_undefined(obj);
          if (obj.kind != Kind::String && !obj.is_sequence_like())
            fail("'" + type_name(obj) + "' object is not subscriptable with a slice");
          return get_item(obj, slice);
        }
        return get_item(obj, eval(sub, scope));
      }
      case ExprKind::Slice:
        fail("a slice outside a subscript");
      case ExprKind::Call: {
        Value callee = eval(*e.args[0], scope);
        CallArgs args = eval_args(e, 1, scope);
        if (callee.kind == Kind::Macro) return call_macro(*callee.macro, args);
        if (callee.kind == Kind::Function) return call_function(callee, args);
        if (callee.is_undefined()) fail_undefined(callee);
        fail("'" + type_name(callee) + "' object is not callable");
      }
      case ExprKind::Filter:
        return apply_filter(e.name, eval(*e.args[0], scope), eval_args(e, 1, scope));
      case ExprKind::Test: {
        bool r = apply_test(e.name, eval(*e.args[0], scope), eval_args(e, 1, scope));
        return Value::boolean(r != e.negated);
      }
      case ExprKind::Unary: {
        Value v = eval(*e.args[0], scope);
        if (e.name == "not") return Value::boolean(!truthy(v));
        if (!v.is_number()) {
          if (v.is_undefined()) fail_undefined(v);
          fail("bad operand type for unary " + e.name + ": '" + type_name(v) + "'");
        }
        if (e.name == "+") return v.kind == Kind::Bool ? Value::integer(v.b) : v;
        if (v.kind == Kind::Float) return Value::real(-v.f);
        if (int_of(v) == INT64_MIN) fail("integer arithmetic beyond 64 bits is not supported");
        return Value::integer(-int_of(v));
      }
      case ExprKind::Binary: {
        if (e.name == "and" || e.name == "or") {
          Value a = eval(*e.args[0], scope);
          if (truthy(a) == (e.name == "or")) return a;
          return eval(*e.args[1], scope);
        }
        Value a = eval(*e.args[0], scope);
        Value b = eval(*e.args[1], scope);
        if (e.name == "~") return Value::string(to_str(a) + to_str(b));
        return arithmetic(e.name, a, b);
      }
      case ExprKind::Compare: {
        Value left = eval(*e.args[0], scope);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value right = eval(*e.args[k + 1], scope);
          const std::string& op = e.ops[k];
          bool r;
          if (op == "==")
            r = equal(left, right);
          else if (op == "!=")
            r = !equal(left, right);
          else if (op == "<")
            r = less(left, right);
          else if (op == ">")
            r = less(right, left);
          else if (op == "<=")
            r = !less(right, left);
          else if (op == ">=")
            r = !less(left, right);
          else
            r = apply_test("in", left, CallArgs{{right}, {}}) == (op == "in");
          if (!r) return Value::boolean(false);
          left = std::move(right);
        }
        return Value::boolean(true);
      }
      case ExprKind::CondExpr:
        if (truthy(eval(*e.args[0], scope))) return eval(*e.args[1], scope);
        if (e.args[2]) return eval(*e.args[2], scope);
        return Value::undefined("the inline if-expression on line " + std::to_string(e.pos.line) +
                                " evaluated to false and no else section was defined.");
    }
    fail("internal error: unknown expression");
  }

  Value call_macro(const MacroRef& ref, const CallArgs& args) {
    const Stmt& m = *ref.node->stmt;
    if (args.pos.size() > m.params.size())
      fail("macro '" + m.text + "' takes not more than " + std::to_string(m.params.size()) + " argument(s)");
    if (depth_ >= limits_.max_call_depth)
      fail("macro calls nest deeper than " + std::to_string(limits_.max_call_depth) + " (RenderLimits)");
    auto frame = std::make_shared<Scope>();
    frame->parent = ref.scope.lock();
    RF_ASSERT(frame->parent);
    std::vector<bool> given(m.params.size(), false);
    for (size_t k = 0; k < args.pos.size(); ++k) {
      frame->set(m.params[k], args.pos[k]);
      given[k] = true;
    }
    for (const auto& [key, v] : args.kw) {
      auto it = std::find(m.params.begin(), m.params.end(), key);
      if (it == m.params.end()) fail("macro '" + m.text + "' takes no keyword argument '" + key + "'");
      const size_t k = static_cast<size_t>(it - m.params.begin());
      if (given[k]) fail("macro '" + m.text + "' got multiple values for argument '" + key + "'");
      frame->set(key, v);
      given[k] = true;
    }
    for (size_t k = 0; k < m.params.size(); ++k) {
      if (given[k]) continue;
      // Defaults are evaluated at call time in the macro's frame, as jinja2 does (one may name an earlier one).
      frame->set(m.params[k], m.defaults[k] ? eval(*m.defaults[k], frame)
                                            : Value::undefined("parameter '" + m.params[k] + "' was not provided"));
    }
    ++depth_;
    std::string out;
    try {
      exec(m.body, frame, out);
    } catch (...) {
      --depth_;
      throw;
    }
    --depth_;
    return Value::string(std::move(out));
  }

  const Program& prog_;
  const RenderLimits& limits_;
  std::vector<ScopePtr> defining_scopes_;  // the scopes macros were defined in (MacroRef holds them weakly)
  std::string* top_ = nullptr;
  std::vector<GenerationSpan>* spans_ = nullptr;
  int depth_ = 0;
  long long iterations_ = 0;
};

}  // namespace

Rendered evaluate(const Program& program, const nlohmann::ordered_json& variables, const RenderLimits& limits) {
  return Evaluator(program, limits).run(variables);
}

}  // namespace rf::text::detail
