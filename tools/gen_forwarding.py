#!/usr/bin/env python3
"""Generates `burn-te/src/decorators/forward.rs`: the `forward_backend!` macro of backend decorators.

A backend decorator (`Te<B>`, `Debug<B>`) implements Burn's whole `Backend` trait by forwarding every op, required
and default alike, to its inner backend `B` (the inner backend may override a default with a faster version), except
the ops its `Decorator` impl changes. Writing ~470 forwarding methods by hand would rot with every Burn release, so
this script reads them from the burn-backend sources in the cargo registry and writes the macro.

Usage (from anywhere; Python 3 standard library only):

    python3 tools/gen_forwarding.py            # regenerate burn-te/src/decorators/forward.rs
    python3 tools/gen_forwarding.py --check    # exit 1 if the file is not up to date
    python3 tools/gen_forwarding.py --burn-backend PATH   # use this burn-backend source tree

What it does:
- parses the traits in `TRAITS` (signatures only; default bodies are skipped: the forwarding replaces them);
- checks that `Backend`'s supertraits are exactly the traits it implements plus `IMPLIED_SUPERTRAITS`, so a new
  supertrait in a later Burn version is an error here, not a silently missing impl;
- routes every op that `trait Decorator` (burn-te/src/decorators/mod.rs) declares through the decorator
  (`<Self as Decorator>::float_matmul(lhs, rhs)`), and every other op to `B::op(args)`;
- converts the types that are generic over the backend and so differ nominally between `Te<B>` and `B` although
  their content is identical (`TensorPrimitive<B>`, `MaxPool2dWithIndices<B>`, ...; see `REBRANDED`) with
  `Rebrand::rebrand`, field-by-field moves written in decorators/mod.rs;
- fails on anything it does not know how to forward (a new backend-generic type, a `#[cfg]` on a method, an
  unknown type name, ...), rather than generating something wrong;
- formats the result with `rustfmt --edition 2024` when rustfmt is on the PATH.

The output is deterministic: it depends only on the burn-backend sources, decorators/mod.rs and the rustfmt version.
"""

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUTPUT = os.path.join(REPO, "burn-te", "src", "decorators", "forward.rs")
DECORATOR_RS = os.path.join(REPO, "burn-te", "src", "decorators", "mod.rs")
BURN_BACKEND_VERSION = "0.21.0"

# (file under burn-backend's src/, trait). Generic traits (`FooOps<B: Backend>`) are implemented as
# `impl<B: Backend> FooOps<Te<B>> for Te<B>`, the others as `impl<B: Backend> Foo for Te<B>`.
TRAITS = [
    ("backend/base.rs", "BackendTypes"),
    ("backend/base.rs", "Backend"),
    ("backend/ops/tensor.rs", "FloatTensorOps"),
    ("backend/ops/int_tensor.rs", "IntTensorOps"),
    ("backend/ops/bool_tensor.rs", "BoolTensorOps"),
    ("backend/ops/qtensor.rs", "QTensorOps"),
    ("backend/ops/modules/base.rs", "ModuleOps"),
    ("backend/ops/activation.rs", "ActivationOps"),
    ("backend/ops/transaction.rs", "TransactionOps"),
]

# Supertraits of `Backend` that `Te<B>` gets from the user's derives and the `Decorator` bound, not from this macro.
IMPLIED_SUPERTRAITS = {"Clone", "Default", "Sized", "Send", "Sync", "core::fmt::Debug", "'static"}

# Types generic over the backend, with the same content for `Te<B>` and `B`: moved across with `Rebrand::rebrand`
# (decorators/mod.rs has one impl per type; a type missing there is a compile error, not a silent bug).
REBRANDED = {
    "TensorPrimitive",
    "TransactionPrimitive",
    "QuantizationParametersPrimitive",
    "MaxPool1dWithIndices",
    "MaxPool2dWithIndices",
    "MaxPool1dBackward",
    "MaxPool2dBackward",
    "DeformConv2dBackward",
}

# Aliases over the backend's associated types: `FloatTensor<Te<B>>` *is* `FloatTensor<B>`, nothing to convert.
ALIASES = {"Device", "FloatElem", "IntElem", "BoolElem", "FloatTensor", "IntTensor", "BoolTensor", "QuantizedTensor"}

# Where the invoking crate finds every name used in the generated signatures (re-exported by `forward::prelude`).
# A name missing here is an error of this script.
PRELUDE = {
    "burn::tensor::backend": [
        "Backend",
        "BackendTypes",
        "DTypeUsageSet",
        "DeviceOps",
        "ExecutionError",
    ],
    "burn::tensor": [
        "BoolDType",
        "DType",
        "Distribution",
        "Element",
        "IndexingUpdateOp",
        "FloatDType",
        "IntDType",
        "Scalar",
        "Shape",
        "Slice",
        "TensorData",
        "TensorMetadata",
        "TensorPrimitive",
        "TransactionPrimitive",
    ],
    "burn::tensor::ops": [
        "ActivationOps",
        "AttentionModuleOptions",
        "BoolTensor",
        "BoolTensorOps",
        "Conv2dBackward",
        "Conv3dBackward",
        "ConvOptions",
        "ConvTransposeOptions",
        "DeformConv2dBackward",
        "DeformConvOptions",
        "Device",
        "FloatTensor",
        "FloatTensorOps",
        "GridSampleOptions",
        "IntElem",
        "IntTensor",
        "IntTensorOps",
        "InterpolateOptions",
        "MaxPool1dBackward",
        "MaxPool1dWithIndices",
        "MaxPool2dBackward",
        "MaxPool2dWithIndices",
        "ModuleOps",
        "PadMode",
        "PaddedConvOptions",
        "QTensorOps",
        "QuantizedTensor",
        "TransactionOps",
        "TransactionPrimitiveData",
        "UnfoldOptions",
        "FloatElem",
        "BoolElem",
    ],
    "burn::tensor::quantization": [
        "Calibration",
        "QTensorPrimitive",
        "QuantPropagation",
        "QuantScheme",
        "QuantizationParametersPrimitive",
    ],
    "core::future": ["Future"],
    "core::ops": ["Range"],
    "std::string": ["String"],
    "std::vec": ["Vec"],
}

# Names that need no import: primitive types, prelude traits and types, keywords, generic parameters.
NO_IMPORT = {
    "Self", "Option", "Result", "Some", "None", "Ok", "Err", "Fn", "FnMut", "FnOnce", "Iterator", "Send", "Sync",
    "Sized", "usize", "isize", "u8", "u16", "u32", "u64", "i8", "i16", "i32", "i64", "f32", "f64", "bool", "str",
    "mut", "const", "impl", "dyn", "where", "for", "as", "Output", "Item",
}

KEYWORDS = {"mut", "const", "impl", "dyn", "where", "for", "as", "fn", "pub", "async", "unsafe", "in", "crate",
            "super", "self", "Self"}

LINE_WIDTH = 100  # rustfmt's default max_width


# --------------------------------------------------------------------------------------------------------------------
# Lexer: just enough Rust to find item boundaries and render signatures (comments dropped, literals kept whole).

TOKEN_RE = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<comment>//[^\n]*|/\*(?:.|\n)*?\*/)
  | (?P<str>b?r(?P<hashes>\#*)"(?:.|\n)*?"(?P=hashes)|b?"(?:\\.|[^"\\])*")
  | (?P<char>b?'(?:\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^\\'])')
  | (?P<lifetime>'[A-Za-z_][A-Za-z0-9_]*)
  | (?P<num>[0-9][0-9_]*(?:\.[0-9][0-9_]*)?(?:[eE][+-]?[0-9]+)?[A-Za-z0-9_]*)
  | (?P<ident>r\#[A-Za-z_][A-Za-z0-9_]*|[A-Za-z_][A-Za-z0-9_]*)
  | (?P<punct>::|->|=>|==|!=|<=|>=|&&|\|\||\.\.=|\.\.\.|\.\.|\+=|-=|\*=|/=|%=|\^=|&=|\|=|[^\s])
    """,
    re.VERBOSE,
)


def tokenize(text, path):
    tokens = []
    pos = 0
    while pos < len(text):
        m = TOKEN_RE.match(text, pos)
        if not m:
            fail(f"{path}: cannot tokenize at offset {pos}: {text[pos:pos + 40]!r}")
        kind = m.lastgroup if m.lastgroup != "hashes" else "str"
        if kind not in ("ws", "comment"):
            line = text.count("\n", 0, pos) + 1
            tokens.append((m.group(kind), line))
        pos = m.end()
    return [t for t, _ in tokens], [l for _, l in tokens]


def fail(message):
    sys.exit(f"gen_forwarding.py: error: {message}")


# --------------------------------------------------------------------------------------------------------------------
# Parser.

class Method:
    def __init__(self, trait, name, generics, params, ret, where, has_default, line):
        self.trait = trait
        self.name = name
        self.generics = generics  # tokens between the fn's `<` `>`, or []
        self.params = params  # [(name, type tokens)]
        self.ret = ret  # tokens after `->`, or []
        self.where = where  # tokens after `where`, or []
        self.has_default = has_default
        self.line = line


class Trait:
    def __init__(self, name, param, supertraits, methods, assoc_types):
        self.name = name
        self.param = param  # the backend parameter (`B` of `FloatTensorOps<B: Backend>`), or None
        self.supertraits = supertraits  # [tokens]
        self.methods = methods
        self.assoc_types = assoc_types  # [name]


def matching(tokens, i, open_, close):
    """Index of the token closing the group opened at tokens[i]."""
    depth = 0
    for j in range(i, len(tokens)):
        if tokens[j] == open_:
            depth += 1
        elif tokens[j] == close:
            depth -= 1
            if depth == 0:
                return j
    fail(f"unbalanced {open_}{close}")


def split_top_level(tokens, sep=","):
    """Splits on `sep` outside (), [], {}, <>; drops empty trailing parts."""
    parts, current, depth = [], [], 0
    for t in tokens:
        if t in ("(", "[", "{", "<"):
            depth += 1
        elif t in (")", "]", "}", ">"):
            depth -= 1
        if t == sep and depth == 0:
            parts.append(current)
            current = []
        else:
            current.append(t)
    if current:
        parts.append(current)
    return parts


def parse_trait(path, trait_name):
    with open(path, encoding="utf-8") as f:
        tokens, lines = tokenize(f.read(), path)
    start = None
    for i in range(len(tokens) - 2):
        if tokens[i] == "pub" and tokens[i + 1] == "trait" and tokens[i + 2] == trait_name:
            start = i + 3
            break
    if start is None:
        fail(f"{path}: `pub trait {trait_name}` not found")

    i = start
    param = None
    if tokens[i] == "<":
        end = matching(tokens, i, "<", ">")
        generics = split_top_level(tokens[i + 1:end])
        if len(generics) != 1 or generics[0][1:] != [":", "Backend"]:
            fail(f"{path}: {trait_name}: expected `<B: Backend>`, got {render(tokens[i:end + 1])}")
        param = generics[0][0]
        i = end + 1
    supertraits = []
    if tokens[i] == ":":
        body = tokens.index("{", i)
        supertraits = [s for s in split_top_level(tokens[i + 1:body], "+")]
        i = body
    if tokens[i] != "{":
        fail(f"{path}: {trait_name}: unexpected {tokens[i]!r} before the trait body")
    end = matching(tokens, i, "{", "}")

    methods, assoc_types = [], []
    i += 1
    attributes = []
    while i < end:
        t = tokens[i]
        if t == "#":
            close = matching(tokens, i + 1, "[", "]")
            attributes.append(tokens[i + 2:close])
            i = close + 1
            continue
        for attribute in attributes:
            # An attribute is fine to drop except one that changes what exists (cfg) or how it is called.
            if attribute[0] not in ("allow", "doc", "cfg_attr", "must_use", "inline"):
                fail(f"{path}:{lines[i]}: {trait_name}: attribute `#[{render(attribute)}]` is not handled")
            if attribute[0] == "cfg_attr" and "doc" not in attribute:
                fail(f"{path}:{lines[i]}: {trait_name}: attribute `#[{render(attribute)}]` is not handled")
        attributes = []
        if t == "type":
            name = tokens[i + 1]
            semi = tokens.index(";", i)
            if "=" in tokens[i:semi]:
                fail(f"{path}:{lines[i]}: {trait_name}::{name}: associated type defaults are not handled")
            assoc_types.append(name)
            i = semi + 1
        elif t == "fn":
            method, i = parse_method(tokens, lines, i, path, trait_name)
            methods.append(method)
        else:
            fail(f"{path}:{lines[i]}: {trait_name}: unexpected {t!r} in the trait body (async/unsafe/const items "
                 f"are not handled)")
    return Trait(trait_name, param, supertraits, methods, assoc_types)


def parse_method(tokens, lines, i, path, trait_name):
    line = lines[i]
    name = tokens[i + 1]
    i += 2
    generics = []
    if tokens[i] == "<":
        close = matching(tokens, i, "<", ">")
        generics = tokens[i + 1:close]
        i = close + 1
    if tokens[i] != "(":
        fail(f"{path}:{line}: {trait_name}::{name}: expected `(`")
    close = matching(tokens, i, "(", ")")
    params = []
    for part in split_top_level(tokens[i + 1:close]):
        if "self" in part[:3] or ":" not in part:
            fail(f"{path}:{line}: {trait_name}::{name}: methods taking self are not handled")
        colon = part.index(":")
        pattern, ty = part[:colon], part[colon + 1:]
        if pattern and pattern[0] == "mut":
            pattern = pattern[1:]
        if len(pattern) != 1 or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", pattern[0]):
            fail(f"{path}:{line}: {trait_name}::{name}: parameter pattern {render(part)} is not handled")
        params.append((pattern[0], ty))
    i = close + 1

    # Return type and where clause, up to the body `{` or `;` (no braces in signatures).
    ret, where = [], []
    target = None
    while tokens[i] not in ("{", ";"):
        if tokens[i] == "->" and target is None:
            target = ret
        elif tokens[i] == "where":
            target = where
        else:
            if target is None:
                fail(f"{path}:{line}: {trait_name}::{name}: unexpected {tokens[i]!r} after the parameters")
            target.append(tokens[i])
        i += 1
    has_default = tokens[i] == "{"
    if has_default:
        i = matching(tokens, i, "{", "}")
    params = [(p, strip_crate_paths(ty)) for p, ty in params]
    generics, ret, where = strip_crate_paths(generics), strip_crate_paths(ret), strip_crate_paths(where)
    return Method(trait_name, name, generics, params, ret, where, has_default, line), i + 1


def parse_decorator_hooks(path):
    """The methods of `trait Decorator`: ops routed through the decorator (except its own helpers)."""
    trait = parse_trait(path, "Decorator")
    return {m.name: m for m in trait.methods}


# --------------------------------------------------------------------------------------------------------------------
# Rendering.

def render(tokens):
    out = ""
    prev = None
    for t in tokens:
        if prev is not None and space_between(prev, t):
            out += " "
        out += t
        prev = t
    return out


def is_word(t):
    return re.fullmatch(r"[A-Za-z_0-9]+|'[A-Za-z_][A-Za-z0-9_]*", t) is not None


def space_between(a, b):
    if b in (",", ";", ")", "]", ">", "::", ":", "?", "."):
        return False
    if a in ("(", "[", "<", "::", "&", "!", "."):
        return False
    if b in ("(", "[", "<"):
        return not is_word(a) or a in KEYWORDS
    return True


def substitute(tokens, old, new):
    return [new if t == old else t for t in tokens]


def strip_crate_paths(tokens):
    """`crate::tensor::IndexingUpdateOp` -> `IndexingUpdateOp` (then found through the prelude): `crate` would
    name the invoking crate in the macro."""
    out, k = [], 0
    while k < len(tokens):
        if tokens[k] in ("crate", "super", "self") and k + 1 < len(tokens) and tokens[k + 1] == "::":
            k += 2
            while k + 1 < len(tokens) and tokens[k + 1] == "::":
                k += 2
        out.append(tokens[k])
        k += 1
    return out


def backend_generic_types(tokens):
    """Names `X` of `X<B>`-like paths in a type (the identifier before each `<`)."""
    return [tokens[k - 1] for k in range(1, len(tokens)) if tokens[k] == "<" and is_word(tokens[k - 1])]


# --------------------------------------------------------------------------------------------------------------------
# Generation.

INDENT = "    "


def method_lines(trait, method, hooks, ambiguous, level):
    pad = INDENT * level
    param = trait.param or "Self"

    def ty(tokens):
        return substitute(tokens, param, "Self") if trait.param else tokens

    # Parameter names without the `_` of unused defaults (`_device` -> `device`), unless that clashes.
    names = [p for p, _ in method.params]
    renamed = []
    for p in names:
        bare = p.lstrip("_")
        renamed.append(bare if bare and bare not in names and bare not in renamed else p)

    def rebranded(tokens):
        """Whether the type is a `REBRANDED` type at its top level (nested ones are refused)."""
        generic = [n for n in backend_generic_types(tokens) if n in REBRANDED]
        if not generic:
            return False
        if tokens[0] in REBRANDED and tokens[1] == "<" and tokens[-1] == ">" and len(generic) == 1:
            return True
        fail(f"{trait.name}::{method.name}: nested backend-generic type {render(tokens)} is not handled")

    # Every `X<B>` must be an alias over the associated types or a rebranded type.
    for tokens in [ty for _, ty in method.params] + [method.ret, method.generics, method.where]:
        for k, t in enumerate(tokens):
            if t == param and trait.param:
                if not (k >= 2 and tokens[k - 1] == "<" and tokens[k - 2] in REBRANDED | ALIASES):
                    fail(f"{trait.name}::{method.name}: unknown use of the backend in {render(tokens)}")

    args = []
    for (_, tokens), name in zip(method.params, renamed):
        args.append(f"{name}.rebrand()" if rebranded(tokens) else name)

    is_future = method.ret[:1] == ["impl"] and "Future" in method.ret
    if is_future and any(n in REBRANDED for n in backend_generic_types(method.ret)):
        fail(f"{trait.name}::{method.name}: a future of a backend-generic type is not handled")

    if method.name in hooks:
        # A hook takes the inner backend's types: arguments are rebranded to them; a result would need the way back.
        if method.ret and not is_future and rebranded(method.ret):
            fail(f"{trait.name}::{method.name}: a Decorator hook returning a backend-generic type is not handled")
        callee = "<Self as Decorator>"
    else:
        qualified = f"<B as {trait.name}<B>>" if trait.param else f"<B as {trait.name}>"
        callee = qualified if method.name in ambiguous else "B"
    call = f"{callee}::{method.name}({', '.join(args)})"
    # A future is returned as it is: a future of a rebranded type is refused above.
    suffix = ".rebrand()" if method.ret and not is_future and rebranded(method.ret) else ""

    # The ops (not `Backend`'s own methods) tell the decorator they start, with their float tensor arguments, and
    # those with a float output that they finished (`Decorator::op_started` / `op_finished`).
    # Queries that take only references (`float_device(&tensor)`) are not ops.
    query = bool(method.params) and all(tokens[:1] == ["&"] for _, tokens in method.params)
    observed = trait.name not in ("Backend", "BackendTypes") and not query
    float_type = ["FloatTensor", "<", param, ">"]
    float_inputs = [name for (_, tokens), name in zip(method.params, renamed) if tokens == float_type]
    float_output = method.ret == float_type

    # Signature: on one line when it fits, else one parameter per line (rustfmt's layout).
    generics = [render(part) for part in split_top_level(ty(method.generics))]
    params = [f"{name}: {render(ty(tokens))}" for (_, tokens), name in zip(method.params, renamed)]
    ret = f" -> {render(ty(method.ret))}" if method.ret else ""
    where = ty(method.where)
    head = f"fn {method.name}" + (f"<{', '.join(generics)}>" if generics else "")
    one_line = f"{pad}{head}({', '.join(params)}){ret}"
    lines = []
    if len(one_line) + (0 if where else 2) <= LINE_WIDTH:
        lines.append(one_line)
    else:
        if len(f"{pad}{head}(") <= LINE_WIDTH:
            lines.append(f"{pad}{head}(")
        else:
            lines.append(f"{pad}fn {method.name}<")
            lines += [f"{pad}{INDENT}{g}," for g in generics]
            lines.append(f"{pad}>(")
        lines += [f"{pad}{INDENT}{p}," for p in params]
        lines.append(f"{pad}){ret}")
    if where:
        lines.append(f"{pad}where")
        lines += [f"{pad}{INDENT}{render(part)}," for part in split_top_level(where)]
        lines.append(f"{pad}{{")
    else:
        lines[-1] += " {"
    body = pad + INDENT
    if observed:
        refs = ", ".join(f"&{name}" for name in float_inputs)
        started = f'<Self as Decorator>::op_started("{method.name}", &[{refs}])'
        if float_output:
            lines.append(f"{body}let __inputs = {started};")
            lines.append(f"{body}let __output = {call}{suffix};")
            lines.append(f'{body}<Self as Decorator>::op_finished("{method.name}", __inputs, &__output);')
            lines.append(f"{body}__output")
            lines.append(f"{pad}}}")
            return lines
        lines.append(f"{body}{started};")
    if len(f"{body}{call}{suffix}") <= LINE_WIDTH:
        lines.append(f"{body}{call}{suffix}")
    else:
        lines.append(f"{body}{callee}::{method.name}(")
        lines += [f"{body}{INDENT}{a}," for a in args]
        lines.append(f"{body})")
        if suffix:
            lines.append(f"{body}{suffix}")
    lines.append(f"{pad}}}")
    return lines


def generate(burn_backend):
    src = os.path.join(burn_backend, "src")
    traits = [parse_trait(os.path.join(src, path), name) for path, name in TRAITS]
    by_name = {t.name: t for t in traits}
    hooks = parse_decorator_hooks(DECORATOR_RS)

    # Backend's supertraits must be what this macro implements plus what the decorator type brings.
    supertraits = {render(s) for s in by_name["Backend"].supertraits}
    implemented = {t.name + (f"<Self>" if t.param else "") for t in traits if t.name != "Backend"}
    missing = supertraits - implemented - IMPLIED_SUPERTRAITS
    if missing:
        fail(f"Backend has supertraits this script does not implement: {sorted(missing)}")

    # Names declared by more than one trait are called fully qualified.
    owners = {}
    for t in traits:
        for m in t.methods:
            owners.setdefault(m.name, []).append(t.name)
    ambiguous = {name for name, ts in owners.items() if len(ts) > 1}

    for hook, m in sorted(hooks.items()):
        if hook not in owners:
            if m.has_default:
                continue  # a helper of the decorator, not an op
            fail(f"Decorator::{hook} is not an op of Backend or its ops traits")
        if len(owners[hook]) > 1:
            fail(f"Decorator::{hook} is declared by several traits: {owners[hook]}")

    # Every name the signatures use must come from the prelude.
    exported = {name for names in PRELUDE.values() for name in names}
    used = set()
    for t in traits:
        for m in t.methods:
            for tokens in [m.generics, m.ret, m.where] + [ty for _, ty in m.params]:
                used |= {tok for tok in tokens if re.fullmatch(r"[A-Z][A-Za-z0-9_]*", tok)}
    generic_params = {p.split(":")[0] for t in traits for m in t.methods for p in
                      [render(g) for g in split_top_level(m.generics)]}
    generic_params = {re.sub(r"^const ", "", p).strip() for p in generic_params}
    used |= {"Backend", "BackendTypes"} | {t.name for t in traits}
    unknown = used - exported - NO_IMPORT - generic_params - {t.param for t in traits if t.param}
    if unknown:
        fail(f"names used in signatures but missing from PRELUDE: {sorted(unknown)}")

    out = []
    w = out.append
    w("// @generated by tools/gen_forwarding.py from burn-backend " + BURN_BACKEND_VERSION + ". Do not edit by hand.")
    w("//")
    w("// Regenerate after a Burn upgrade, or after adding an op to `trait Decorator` (decorators/mod.rs), with")
    w("//     python3 tools/gen_forwarding.py")
    w("// and check that it is up to date with")
    w("//     python3 tools/gen_forwarding.py --check")
    w("")
    w("//! The forwarding of every op of a backend decorator to its inner backend:")
    w("//! [`forward_backend!`](crate::forward_backend).")
    w("")
    w("/// Every name the generated impls use, for the invoking crate (which needs no `use` of its own).")
    w("#[doc(hidden)]")
    w("pub mod prelude {")
    for module in sorted(PRELUDE):
        names = sorted(set(PRELUDE[module]) & used)
        if not names:
            continue
        w(f"    pub use {module}::{{{', '.join(names)}}};")
    w("    pub use crate::decorators::{Decorator, Rebrand};")
    w("}")
    w("")

    total = sum(len(t.methods) for t in traits)
    defaults = sum(m.has_default for t in traits for m in t.methods)
    w("/// Implements Burn's `Backend` for a backend decorator, forwarding every op to the inner backend.")
    w("///")
    w("/// `forward_backend!(Te)` takes a type `Te<B>` with one type parameter, the inner backend, that implements")
    w("/// [`Decorator<Inner = B>`](crate::Decorator). It implements `BackendTypes` (the primitives are the inner")
    w("/// backend's), `Backend` and every ops trait for `Te<B>`:")
    w(f"/// {total} methods, the {defaults} with a default body included, so that an inner backend's faster versions")
    routed = ", ".join(f"`{name}`" for name in sorted(h for h in hooks if h in owners))
    w("/// of default ops are kept. The ops that `Decorator` declares")
    w(f"/// ({routed}) go through the decorator; every other op is `B::op(args)`.")
    w("///")
    w("/// ```ignore")
    w("/// #[derive(Clone, Default, Debug)]")
    w("/// pub struct Te<B>(core::marker::PhantomData<B>);")
    w("///")
    w("/// impl<B: burn::tensor::backend::Backend> burn_te::Decorator for Te<B> {")
    w("///     type Inner = B;")
    w("///     fn name(device: &B::Device) -> String {")
    w("///         format!(\"te<{}>\", B::name(device))")
    w("///     }")
    w("/// }")
    w("///")
    w("/// burn_te::forward_backend!(Te);")
    w("/// ```")
    w("///")
    w("/// Generated by `tools/gen_forwarding.py`.")
    w("#[macro_export]")
    w("macro_rules! forward_backend {")
    w("    ($decorator:ident) => {")
    w("        const _: () = {")
    w("            // The decorator under a name that the prelude's glob import below cannot shadow.")
    w("            type __Decorated<B> = $decorator<B>;")
    w("")
    w("            const _: () = {")
    w("                #[allow(unused_imports)]")
    w("                use $crate::decorators::forward::prelude::*;")
    level = 4
    pad = INDENT * level
    for t in traits:
        w("")
        trait_path = f"{t.name}<__Decorated<B>>" if t.param else t.name
        w(f"{pad}impl<B: Backend> {trait_path} for __Decorated<B>")
        w(f"{pad}where")
        w(f"{pad}{INDENT}__Decorated<B>: Decorator<Inner = B>,")
        w(f"{pad}{{")
        for name in t.assoc_types:
            w(f"{pad}{INDENT}type {name} = B::{name};")
        for k, m in enumerate(t.methods):
            if k > 0 or t.assoc_types:
                w("")
            out.extend(method_lines(t, m, hooks, ambiguous, level + 1))
        w(f"{pad}}}")
    w("            };")
    w("        };")
    w("    };")
    w("}")
    return "\n".join(out) + "\n"


def rustfmt(text):
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "forward.rs")
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            subprocess.run(["rustfmt", "--edition", "2024", path], check=True)
            with open(path, encoding="utf-8") as f:
                return f.read()
    except FileNotFoundError:
        print("gen_forwarding.py: warning: rustfmt not found, output left unformatted", file=sys.stderr)
        return text


def find_burn_backend():
    home = os.path.expanduser("~")
    cargo_home = os.environ.get("CARGO_HOME", os.path.join(home, ".cargo"))
    found = sorted(glob.glob(os.path.join(cargo_home, "registry", "src", "*", f"burn-backend-{BURN_BACKEND_VERSION}")))
    if not found:
        fail(f"burn-backend-{BURN_BACKEND_VERSION} not found under {cargo_home}/registry/src (run `cargo fetch`)")
    return found[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the generated file is not up to date")
    parser.add_argument("--burn-backend", help="burn-backend source tree (default: the cargo registry's)")
    parser.add_argument("--output", default=OUTPUT, help="output file (default: %(default)s)")
    args = parser.parse_args()

    text = rustfmt(generate(args.burn_backend or find_burn_backend()))
    if args.check:
        try:
            with open(args.output, encoding="utf-8") as f:
                current = f.read()
        except FileNotFoundError:
            current = None
        if current != text:
            fail(f"{os.path.relpath(args.output, REPO)} is out of date; run python3 tools/gen_forwarding.py")
        return
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {os.path.relpath(args.output, REPO)}")


if __name__ == "__main__":
    main()
