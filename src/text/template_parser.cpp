#include "text/template_parser.h"

#include <set>

#include "core/error.h"
#include "text/template_builtins.h"
#include "text/template_lexer.h"

namespace rf::text::detail {
namespace {

// Python nests expressions this deep before its own parser gives up; a hostile `((((...` must not overflow ours.
constexpr int kMaxNesting = 200;

class Parser {
 public:
  Parser(std::vector<Token> tokens, Program& program) : toks_(std::move(tokens)), prog_(program) {}

  Body parse_all() {
    std::string end;
    Body body = parse_body({}, &end);
    return body;
  }

 private:
  const Token& cur() const { return toks_[k_]; }
  const Token& peek(size_t ahead = 1) const { return toks_[std::min(k_ + ahead, toks_.size() - 1)]; }
  Pos pos() const { return {cur().line, cur().col}; }
  void next() {
    if (k_ + 1 < toks_.size()) ++k_;
  }

  [[noreturn]] void fail(const std::string& why) const { fail_at(pos(), why); }
  [[noreturn]] void fail_at(Pos p, const std::string& why) const {
    throw Error(prog_.origin + ":" + std::to_string(p.line) + ":" + std::to_string(p.col) + ": " + why);
  }

  static std::string describe(const Token& t) {
    switch (t.type) {
      case Tok::Data:
        return "template data";
      case Tok::VarBegin:
        return "begin of print statement";
      case Tok::VarEnd:
        return "end of print statement";
      case Tok::BlockBegin:
        return "begin of statement block";
      case Tok::BlockEnd:
        return "end of statement block";
      case Tok::Name:
        return "'" + t.text + "'";
      case Tok::String:
        return "string";
      case Tok::Int:
        return "integer";
      case Tok::Float:
        return "float";
      case Tok::Op:
        return "'" + t.text + "'";
      case Tok::End:
        return "end of template";
    }
    return "token";
  }

  bool is_op(const char* op) const { return cur().type == Tok::Op && cur().text == op; }
  bool is_name(const char* name) const { return cur().type == Tok::Name && cur().text == name; }
  void expect_op(const char* op) {
    if (!is_op(op)) fail(std::string("expected '") + op + "', got " + describe(cur()));
    next();
  }
  void expect_block_end() {
    if (cur().type != Tok::BlockEnd) fail("expected end of statement block, got " + describe(cur()));
    next();
  }
  std::string expect_name() {
    if (cur().type != Tok::Name) fail("expected a name, got " + describe(cur()));
    std::string n = cur().text;
    next();
    return n;
  }

  struct DepthGuard {
    int& d;
    DepthGuard(int& depth, const Parser& p) : d(depth) {
      if (++d > kMaxNesting)
        p.fail("the template nests expressions or blocks more than " + std::to_string(kMaxNesting) + " deep");
    }
    ~DepthGuard() { --d; }
  };

  // Statements until one of `ends` opens a block (`{% end... %}`, `{% else %}`): *found names it, its `{%` and name
  // consumed. With no ends, until the template's end.
  Body parse_body(const std::set<std::string>& ends, std::string* found, Pos opened = {}) {
    Body body;
    while (true) {
      const Token& t = cur();
      if (t.type == Tok::End) {
        if (!ends.empty())
          fail_at(opened, "unexpected end of template: the block opened here is never closed (expected " +
                              join_names(ends) + ")");
        return body;
      }
      if (t.type == Tok::Data) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::Text;
        s->pos = pos();
        s->text = t.text;
        body.push_back(std::move(s));
        next();
      } else if (t.type == Tok::VarBegin) {
        auto s = std::make_unique<Stmt>();
        s->kind = StmtKind::Print;
        s->pos = pos();
        next();
        s->expr = parse_tuple(true, {});
        if (cur().type != Tok::VarEnd) fail("expected end of print statement, got " + describe(cur()));
        next();
        body.push_back(std::move(s));
      } else if (t.type == Tok::BlockBegin) {
        Pos at = pos();
        next();
        if (cur().type != Tok::Name) fail("expected a statement name, got " + describe(cur()));
        const std::string tag = cur().text;
        if (ends.count(tag)) {
          next();
          *found = tag;
          return body;
        }
        body.push_back(parse_statement(at));
      } else {
        fail("unexpected " + describe(t));
      }
    }
  }

  static std::string join_names(const std::set<std::string>& names) {
    std::string out;
    for (const auto& n : names) out += (out.empty() ? "'" : " or '") + n + "'";
    return out;
  }

  StmtPtr parse_statement(Pos at) {
    DepthGuard guard(depth_, *this);  // blocks nest through this recursion too
    const std::string tag = cur().text;
    auto s = std::make_unique<Stmt>();
    s->pos = at;
    next();
    if (tag == "if") {
      s->kind = StmtKind::If;
      while (true) {
        s->conds.push_back(parse_tuple(false, {}));
        expect_block_end();
        std::string found;
        s->bodies.push_back(parse_body({"elif", "else", "endif"}, &found, at));
        if (found == "elif") continue;
        if (found == "else") {
          expect_block_end();
          s->bodies.push_back(parse_body({"endif"}, &found, at));
        }
        break;
      }
      expect_block_end();
    } else if (tag == "for") {
      s->kind = StmtKind::For;
      s->targets = parse_targets("in");
      if (!is_name("in")) fail("expected 'in', got " + describe(cur()));
      next();
      s->expr = parse_tuple(false, {"recursive"});
      if (is_name("if")) {
        next();
        s->cond = parse_expression(true);
      }
      if (is_name("recursive")) fail("recursive for loops are not supported");
      expect_block_end();
      std::string found;
      ++loop_depth_;
      s->body = parse_body({"endfor", "else"}, &found, at);
      --loop_depth_;
      if (found == "else") {
        expect_block_end();
        s->else_body = parse_body({"endfor"}, &found, at);
      }
      expect_block_end();
    } else if (tag == "set") {
      if (cur().type == Tok::Name && peek().type == Tok::Op && peek().text == ".") {
        s->targets.push_back(expect_name());
        next();
        s->attr = expect_name();
      } else {
        s->targets = parse_targets("=");
      }
      if (is_op("=")) {
        s->kind = StmtKind::Set;
        next();
        s->expr = parse_tuple(true, {});
        expect_block_end();
      } else {
        s->kind = StmtKind::SetBlock;
        if (is_op("|")) s->expr = parse_filters(nullptr);
        expect_block_end();
        std::string found;
        s->body = parse_body({"endset"}, &found, at);
        expect_block_end();
      }
    } else if (tag == "macro") {
      s->kind = StmtKind::Macro;
      s->text = expect_name();
      expect_op("(");
      while (!is_op(")")) {
        if (!s->params.empty()) expect_op(",");
        s->params.push_back(expect_name());
        if (is_op("=")) {
          next();
          s->defaults.push_back(parse_expression(true));
        } else {
          if (!s->defaults.empty() && s->defaults.back()) fail("non-default argument follows default argument");
          s->defaults.push_back(nullptr);
        }
      }
      next();
      expect_block_end();
      std::string found;
      const int outer_loops = loop_depth_;
      loop_depth_ = 0;  // a macro's body is its own function: a break there cannot leave the caller's loop
      s->body = parse_body({"endmacro"}, &found, at);
      loop_depth_ = outer_loops;
      if (cur().type == Tok::Name && cur().text == s->text) next();
      expect_block_end();
      auto m = std::make_unique<MacroNode>();
      m->stmt = s.get();
      prog_.macros.push_back(std::move(m));
    } else if (tag == "break" || tag == "continue") {
      if (loop_depth_ == 0) fail_at(at, "'" + tag + "' outside of a loop");
      s->kind = tag == "break" ? StmtKind::Break : StmtKind::Continue;
      expect_block_end();
    } else if (tag == "generation") {
      s->kind = StmtKind::Generation;
      expect_block_end();
      std::string found;
      s->body = parse_body({"endgeneration"}, &found, at);
      expect_block_end();
    } else if (tag == "call" || tag == "filter" || tag == "with" || tag == "include" || tag == "import" ||
               tag == "from" || tag == "extends" || tag == "block" || tag == "autoescape" || tag == "do" ||
               tag == "trans") {
      fail_at(at, "the '{% " + tag + " %}' tag is not supported by ringflex's template engine (docs/text.md)");
    } else {
      fail_at(at, "unknown tag '" + tag + "'");
    }
    return s;
  }

  // `a` or `a, b` (a loop's or set's targets) up to `stop`.
  std::vector<std::string> parse_targets(const char* stop) {
    std::vector<std::string> names;
    const bool paren = is_op("(");
    if (paren) next();
    while (true) {
      names.push_back(expect_name());
      if (!is_op(",")) break;
      next();
      if ((cur().type == Tok::Name && cur().text == stop) || (cur().type == Tok::Op && cur().text == stop) ||
          is_op(")"))
        break;
    }
    if (paren) expect_op(")");
    return names;
  }

  ExprPtr node(ExprKind kind, Pos p) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->pos = p;
    return e;
  }

  bool at_tuple_end(const std::set<std::string>& extra_end) const {
    if (cur().type == Tok::VarEnd || cur().type == Tok::BlockEnd || cur().type == Tok::End) return true;
    if (is_op(")")) return true;
    return cur().type == Tok::Name && extra_end.count(cur().text);
  }

  ExprPtr parse_tuple(bool with_condexpr, const std::set<std::string>& extra_end, bool explicit_parens = false) {
    Pos p = pos();
    std::vector<ExprPtr> items;
    bool comma = false;
    while (true) {
      if (!items.empty()) {
        if (!is_op(",")) break;
        next();
        comma = true;
      }
      if (at_tuple_end(extra_end)) break;
      items.push_back(parse_expression(with_condexpr));
    }
    if (!comma) {
      if (items.size() == 1) return std::move(items[0]);
      if (!explicit_parens) fail("expected an expression, got " + describe(cur()));
    }
    auto t = node(ExprKind::Tuple, p);
    t->args = std::move(items);
    return t;
  }

  ExprPtr parse_expression(bool with_condexpr) {
    DepthGuard guard(depth_, *this);
    Pos p = pos();
    ExprPtr e = parse_or();
    if (!with_condexpr) return e;
    while (is_name("if")) {
      next();
      auto c = node(ExprKind::CondExpr, p);
      auto test = parse_or();
      ExprPtr other;
      if (is_name("else")) {
        next();
        other = parse_expression(true);
      }
      c->args.push_back(std::move(test));
      c->args.push_back(std::move(e));
      c->args.push_back(std::move(other));
      e = std::move(c);
    }
    return e;
  }

  ExprPtr binary(const std::string& op, ExprPtr a, ExprPtr b, Pos p) {
    auto e = node(ExprKind::Binary, p);
    e->name = op;
    e->args.push_back(std::move(a));
    e->args.push_back(std::move(b));
    return e;
  }

  ExprPtr parse_or() {
    Pos p = pos();
    ExprPtr e = parse_and();
    while (is_name("or")) {
      next();
      e = binary("or", std::move(e), parse_and(), p);
    }
    return e;
  }
  ExprPtr parse_and() {
    Pos p = pos();
    ExprPtr e = parse_not();
    while (is_name("and")) {
      next();
      e = binary("and", std::move(e), parse_not(), p);
    }
    return e;
  }
  ExprPtr parse_not() {
    if (is_name("not")) {
      DepthGuard guard(depth_, *this);
      Pos p = pos();
      next();
      auto e = node(ExprKind::Unary, p);
      e->name = "not";
      e->args.push_back(parse_not());
      return e;
    }
    return parse_compare();
  }
  ExprPtr parse_compare() {
    Pos p = pos();
    ExprPtr first = parse_math1();
    ExprPtr cmp;
    while (true) {
      std::string op;
      if (cur().type == Tok::Op && (cur().text == "==" || cur().text == "!=" || cur().text == "<" ||
                                    cur().text == ">" || cur().text == "<=" || cur().text == ">=")) {
        op = cur().text;
        next();
      } else if (is_name("in")) {
        op = "in";
        next();
      } else if (is_name("not") && peek().type == Tok::Name && peek().text == "in") {
        op = "notin";
        next();
        next();
      } else {
        break;
      }
      if (!cmp) {
        cmp = node(ExprKind::Compare, p);
        cmp->args.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->args.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }
  ExprPtr parse_math1() {
    Pos p = pos();
    ExprPtr e = parse_concat();
    while (is_op("+") || is_op("-")) {
      std::string op = cur().text;
      next();
      e = binary(op, std::move(e), parse_concat(), p);
    }
    return e;
  }
  ExprPtr parse_concat() {
    Pos p = pos();
    ExprPtr e = parse_math2();
    while (is_op("~")) {
      next();
      e = binary("~", std::move(e), parse_math2(), p);
    }
    return e;
  }
  ExprPtr parse_math2() {
    Pos p = pos();
    ExprPtr e = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      std::string op = cur().text;
      next();
      e = binary(op, std::move(e), parse_pow(), p);
    }
    return e;
  }
  ExprPtr parse_pow() {
    Pos p = pos();
    ExprPtr e = parse_unary(true);
    while (is_op("**")) {
      next();
      e = binary("**", std::move(e), parse_unary(true), p);
    }
    return e;
  }
  ExprPtr parse_unary(bool with_filter) {
    DepthGuard guard(depth_, *this);
    Pos p = pos();
    ExprPtr e;
    if (is_op("-") || is_op("+")) {
      e = node(ExprKind::Unary, p);
      e->name = cur().text;
      next();
      e->args.push_back(parse_unary(false));
    } else {
      e = parse_primary();
    }
    e = parse_postfix(std::move(e));
    if (with_filter) e = parse_filters(std::move(e));
    return e;
  }

  ExprPtr parse_primary() {
    Pos p = pos();
    const Token& t = cur();
    if (t.type == Tok::Name) {
      auto e = node(ExprKind::Const, p);
      if (t.text == "true" || t.text == "True") {
        e->value = Value::boolean(true);
      } else if (t.text == "false" || t.text == "False") {
        e->value = Value::boolean(false);
      } else if (t.text == "none" || t.text == "None") {
        e->value = Value::none();
      } else {
        e->kind = ExprKind::Name;
        e->name = t.text;
      }
      next();
      return e;
    }
    if (t.type == Tok::String) {
      std::string s;
      while (cur().type == Tok::String) {  // adjacent literals join, as in Python
        s += cur().text;
        next();
      }
      auto e = node(ExprKind::Const, p);
      e->value = Value::string(std::move(s));
      return e;
    }
    if (t.type == Tok::Int || t.type == Tok::Float) {
      auto e = node(ExprKind::Const, p);
      e->value = t.type == Tok::Int ? Value::integer(t.int_value) : Value::real(t.float_value);
      next();
      return e;
    }
    if (is_op("(")) {
      next();
      auto e = parse_tuple(true, {}, true);
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      next();
      auto e = node(ExprKind::List, p);
      while (!is_op("]")) {
        if (!e->args.empty()) {
          expect_op(",");
          if (is_op("]")) break;
        }
        e->args.push_back(parse_expression(true));
      }
      next();
      return e;
    }
    if (is_op("{")) {
      next();
      auto e = node(ExprKind::Dict, p);
      while (!is_op("}")) {
        if (!e->args.empty()) {
          expect_op(",");
          if (is_op("}")) break;
        }
        e->args.push_back(parse_expression(true));
        expect_op(":");
        e->args.push_back(parse_expression(true));
      }
      next();
      return e;
    }
    fail("unexpected " + describe(t));
  }

  // Postfix, filter and test nodes take their operand's position: an error names where the expression starts.
  ExprPtr parse_postfix(ExprPtr e) {
    while (true) {
      Pos p = e->pos;
      if (is_op(".")) {
        next();
        if (cur().type == Tok::Name) {
          auto g = node(ExprKind::Getattr, p);
          g->name = cur().text;
          g->args.push_back(std::move(e));
          next();
          e = std::move(g);
        } else if (cur().type == Tok::Int) {
          auto g = node(ExprKind::Getitem, p);
          auto idx = node(ExprKind::Const, pos());
          idx->value = Value::integer(cur().int_value);
          next();
          g->args.push_back(std::move(e));
          g->args.push_back(std::move(idx));
          e = std::move(g);
        } else {
          fail("expected name or number after '.'");
        }
      } else if (is_op("[")) {
        next();
        std::vector<ExprPtr> subs;
        while (!is_op("]")) {
          if (!subs.empty()) expect_op(",");
          subs.push_back(parse_subscribed());
        }
        next();
        auto g = node(ExprKind::Getitem, p);
        g->args.push_back(std::move(e));
        if (subs.size() == 1) {
          g->args.push_back(std::move(subs[0]));
        } else {
          auto t = node(ExprKind::Tuple, p);
          t->args = std::move(subs);
          g->args.push_back(std::move(t));
        }
        e = std::move(g);
      } else if (is_op("(")) {
        e = parse_call(std::move(e), ExprKind::Call);
      } else {
        return e;
      }
    }
  }

  ExprPtr parse_subscribed() {
    Pos p = pos();
    ExprPtr start;
    if (!is_op(":")) {
      start = parse_expression(true);
      if (!is_op(":")) return start;
    }
    next();
    auto s = node(ExprKind::Slice, p);
    ExprPtr stop, step;
    if (!is_op(":") && !is_op("]") && !is_op(",")) stop = parse_expression(true);
    if (is_op(":")) {
      next();
      if (!is_op("]") && !is_op(",")) step = parse_expression(true);
    }
    s->args.push_back(std::move(start));
    s->args.push_back(std::move(stop));
    s->args.push_back(std::move(step));
    return s;
  }

  // `callee(args)`: for a Filter or Test the operand is already in args[0].
  ExprPtr parse_call(ExprPtr callee, ExprKind kind) {
    ExprPtr e;
    if (kind == ExprKind::Call) {
      e = node(ExprKind::Call, callee->pos);
      e->args.push_back(std::move(callee));
    } else {
      e = std::move(callee);
    }
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) {
        expect_op(",");
        if (is_op(")")) break;
      }
      first = false;
      if (is_op("*") || is_op("**")) fail("*args and **kwargs in calls are not supported");
      if (cur().type == Tok::Name && peek().type == Tok::Op && peek().text == "=") {
        std::string key = cur().text;
        next();
        next();
        e->kwargs.emplace_back(key, parse_expression(true));
      } else {
        if (!e->kwargs.empty()) fail("positional argument after keyword argument");
        e->args.push_back(parse_expression(true));
      }
    }
    next();
    return e;
  }

  std::string dotted_name() {
    std::string n = expect_name();
    while (is_op(".")) {
      next();
      n += "." + expect_name();
    }
    return n;
  }

  ExprPtr parse_filters(ExprPtr e) {
    while (true) {
      Pos p = e ? e->pos : pos();  // a `{% set x | f %}` block's chain starts without an operand
      if (is_op("|")) {
        next();
        Pos at = pos();
        auto f = node(ExprKind::Filter, p);
        f->name = dotted_name();
        if (!has_filter(f->name))
          fail_at(at, is_jinja_filter(f->name)
                          ? "the filter '" + f->name + "' is not supported by ringflex's template engine (docs/text.md)"
                          : "no filter named '" + f->name + "'");
        f->args.push_back(std::move(e));
        e = is_op("(") ? parse_call(std::move(f), ExprKind::Filter) : std::move(f);
      } else if (is_name("is")) {
        next();
        auto t = node(ExprKind::Test, p);
        if (is_name("not")) {
          t->negated = true;
          next();
        }
        Pos at = pos();
        t->name = dotted_name();
        if (!has_test(t->name))
          fail_at(at, is_jinja_test(t->name)
                          ? "the test '" + t->name + "' is not supported by ringflex's template engine (docs/text.md)"
                          : "no test named '" + t->name + "'");
        t->args.push_back(std::move(e));
        if (is_op("(")) {
          e = parse_call(std::move(t), ExprKind::Test);
        } else {
          const bool arg_follows =
              (cur().type == Tok::Name && cur().text != "else" && cur().text != "or" && cur().text != "and") ||
              cur().type == Tok::String || cur().type == Tok::Int || cur().type == Tok::Float || is_op("(") ||
              is_op("[") || is_op("{");
          if (arg_follows) {
            if (is_name("is")) fail("you cannot chain multiple tests with is");
            t->args.push_back(parse_postfix(parse_primary()));
          }
          e = std::move(t);
        }
      } else if (is_op("(")) {
        e = parse_call(std::move(e), ExprKind::Call);
      } else {
        return e;
      }
    }
  }

  std::vector<Token> toks_;
  Program& prog_;
  size_t k_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
};

}  // namespace

std::shared_ptr<Program> parse_program(const std::string& source, const std::string& origin) {
  auto prog = std::make_shared<Program>();
  prog->origin = origin;
  Parser parser(lex_template(source, origin), *prog);
  prog->body = parser.parse_all();
  return prog;
}

}  // namespace rf::text::detail
