// ringflex text: the template's syntax tree and its parser, jinja2's grammar for the statements and expressions
// chat templates use (docs/text.md lists them). Anything else is refused at parse time naming the template, line,
// column and feature. Internal to the template engine.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "text/template_value.h"

namespace rf::text::detail {

struct Pos {
  int line = 1;
  int col = 1;
};

enum class ExprKind {
  Const,     // value
  Name,      // name
  List,      // args
  Tuple,     // args
  Dict,      // args: key, value, key, value, ...
  Getattr,   // args[0].name
  Getitem,   // args[0][args[1]]
  Slice,     // args[0..2]: start, stop, step (null when left out); only as a subscript
  Call,      // args[0](args[1..], kwargs)
  Filter,    // args[0] | name(args[1..], kwargs)
  Test,      // args[0] is [not] name(args[1..], kwargs)
  Unary,     // op args[0]: "-", "+", "not"
  Binary,    // args[0] op args[1]: + - * / // % ** ~ and or
  Compare,   // args[0] ops[0] args[1] ops[1] args[2] ... (chained, Python's way)
  CondExpr,  // args[1] if args[0] else args[2] (args[2] null: Undefined)
};

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  ExprKind kind = ExprKind::Const;
  Pos pos;
  Value value;
  std::string name;  // Name, Getattr's attribute, a filter or test, an operator
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;  // Compare
  bool negated = false;          // Test: `is not`
};

enum class StmtKind {
  Text,      // text
  Print,     // {{ expr }}
  If,        // conds[k] -> bodies[k]; bodies.back() is the else when bodies.size() > conds.size()
  For,       // targets in expr [if cond]: body, else_body
  Set,       // targets (or ns.attr: targets[0] . attr) = expr
  SetBlock,  // targets = rendered body (| filters applied through expr when set, its operand left null)
  Macro,     // macro name(params = defaults): body
  Break,
  Continue,
  Generation,  // {% generation %} body
};

struct Stmt;
using StmtPtr = std::unique_ptr<Stmt>;
using Body = std::vector<StmtPtr>;

struct Stmt {
  StmtKind kind = StmtKind::Text;
  Pos pos;
  std::string text;
  ExprPtr expr;
  ExprPtr cond;                      // For's filter
  std::vector<ExprPtr> conds;        // If
  std::vector<Body> bodies;          // If's branches
  Body body;                         // For, SetBlock, Macro, Generation
  Body else_body;                    // For
  std::vector<std::string> targets;  // For, Set, SetBlock; Macro's name in text
  std::string attr;                  // Set / SetBlock on a namespace: targets[0].attr
  std::vector<std::string> params;   // Macro
  std::vector<ExprPtr> defaults;     // Macro: one per param, null when none
};

// A macro's definition as the evaluator binds it.
struct MacroNode {
  const Stmt* stmt = nullptr;
};

struct Program {
  std::string origin;
  Body body;
  std::vector<std::unique_ptr<MacroNode>> macros;
};

// Throws rf::Error "ORIGIN:LINE:COL: why".
std::shared_ptr<Program> parse_program(const std::string& source, const std::string& origin);

}  // namespace rf::text::detail
