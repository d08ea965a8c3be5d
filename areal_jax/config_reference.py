"""The configuration reference, generated from the code: ``python -m areal_jax.config_reference``.

It prints a Markdown page (MyST-compatible) with

* every key of ``config.base_config()``: its dotted name, type, default and meaning. The meaning
  is the key's comment in ``areal_jax/config.py`` (the comment block right above the key's line
  and its trailing comment; the first sentence is the one-line meaning, the rest detail), read from
  the source with ``tokenize`` and ``ast``, so the reference cannot drift from the code;
* every config file under ``configs/`` with its presets (``get_config(preset)``) and the first line
  of its docstring;
* every environment variable the package reads (``areal_jax.env_vars.REGISTRY``), with the modules
  that read it, found by scanning the source (``env_reads``).

The checked-in page is ``docs/reference/configuration.md``; ``tests/test_config_reference.py``
fails when it differs from this output, when a key has no comment, or when the registry and the
variables read in the source disagree.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import io
import json
import pathlib
import re
import sys
import tokenize

from areal_jax import config as config_lib
from areal_jax import env_vars

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG_SOURCE = pathlib.Path(config_lib.__file__)
PAGE = "docs/reference/configuration.md"
COMMAND = f"python -m areal_jax.config_reference > {PAGE}"
# Where the scan for environment variables looks (relative to the repository root).
SCANNED = ("areal_jax", "launch.py")
REGISTRY_FILE = "areal_jax/env_vars.py"  # (not scanned: it lists the names, it reads none)
# How a variable's name is spelt where the package defines or mentions its own.
OWN_NAME = re.compile(r"\bAREAL_JAX_[A-Z0-9_]*[A-Z0-9]\b")


# ---------------------------------------------------------------------------------------------
# Keys: comments of base_config() in config.py.


def key_comments(source: str | None = None) -> dict[str, tuple[int, str]]:
  """``{dotted key: (line, comment text)}`` for every ``c.<key> = ...`` statement in
  ``base_config``: the comment lines right above the statement (no blank line between) followed
  by the comments at the end of its lines. Nodes (``c.mesh = ConfigDict()``) are included."""
  source = CONFIG_SOURCE.read_text() if source is None else source
  lines = source.splitlines()
  comments, code_lines = {}, set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type == tokenize.COMMENT:
      comments[tok.start[0]] = tok.string.lstrip("#").strip()
    elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                          tokenize.ENDMARKER):
      for line in range(tok.start[0], tok.end[0] + 1):
        code_lines.add(line)
  function = next(n for n in ast.parse(source).body
                  if isinstance(n, ast.FunctionDef) and n.name == "base_config")
  out = {}
  for stmt in function.body:
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
      continue
    key = _dotted(stmt.targets[0])
    if key is None:
      continue
    above, line = [], stmt.lineno - 1
    while line in comments and line not in code_lines and lines[line - 1].strip():
      above.insert(0, comments[line])
      line -= 1
    trailing = [comments[n] for n in range(stmt.lineno, stmt.end_lineno + 1)
                if n in comments and n in code_lines]
    out[key] = (stmt.lineno, " ".join(above + trailing).strip())
  return out


def _dotted(target: ast.expr) -> str | None:
  """``c.rollout.vllm.mode`` -> ``"rollout.vllm.mode"``; None for anything else."""
  parts = []
  while isinstance(target, ast.Attribute):
    parts.insert(0, target.attr)
    target = target.value
  return ".".join(parts) if isinstance(target, ast.Name) and target.id == "c" and parts else None


def flatten(config, prefix: str = "") -> dict:
  """``{dotted key: value}`` of every leaf of a ConfigDict."""
  out = {}
  for key, value in config.items():
    if isinstance(value, config_lib.ConfigDict):
      out.update(flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def split_sentence(text: str) -> tuple[str, str]:
  """``(first sentence, the rest)``: a sentence ends at a period followed by a space and a capital
  letter, a quote or a bracket (``e.g. x`` does not end one)."""
  match = re.search(r"(?<=\.)\s+(?=[A-Z\"'(`$])", text)
  if not match:
    return text, ""
  return text[:match.start()], text[match.end():]


@dataclasses.dataclass(frozen=True)
class Key:
  name: str
  type: str
  default: object
  summary: str
  detail: str


def keys() -> list[Key]:
  """Every leaf key of the base config in source order, with its meaning ("" where none)."""
  values = flatten(config_lib.base_config())
  comments = key_comments()
  order = {k: line for k, (line, _) in comments.items()}
  out = []
  for name in sorted(values, key=lambda k: (order.get(k, 1 << 30), k)):
    summary, detail = split_sentence(comments.get(name, (0, ""))[1])
    out.append(Key(name, _type_name(values[name]), values[name], summary, detail))
  return out


def nodes() -> dict[str, str]:
  """``{dotted name: comment}`` of the sub-trees (``mesh``, ``rollout.vllm``, ...)."""
  leaves = flatten(config_lib.base_config())
  return {k: text for k, (_, text) in key_comments().items() if k not in leaves}


def _type_name(value) -> str:
  if isinstance(value, tuple):
    kinds = sorted({type(v).__name__ for v in value})
    return f"tuple of {' / '.join(kinds)}" if kinds else "tuple"
  return type(value).__name__


def _literal(value) -> str:
  if isinstance(value, str):
    return json.dumps(value, ensure_ascii=False)
  if isinstance(value, tuple):
    inner = ", ".join(_literal(v) for v in value)
    return f"({inner},)" if len(value) == 1 else f"({inner})"
  return repr(value)


# ---------------------------------------------------------------------------------------------
# Environment variables: what the source reads.


@dataclasses.dataclass
class EnvScan:
  reads: dict[str, set[str]]  # variable -> files that read it by name or constant
  defined: dict[str, set[str]]  # AREAL_JAX_* string constants -> files that hold them
  unresolved: list[str]  # "file:line" of reads whose variable the scan cannot name
  mentions: dict[str, set[str]]  # AREAL_JAX_* names anywhere in the text -> files

  def names(self) -> set[str]:
    """Every variable the package reads."""
    return set(self.reads) | set(self.defined)

  def where(self, name: str) -> list[str]:
    """The files that read ``name`` (that define it where it is read through a parameter)."""
    return sorted(self.reads.get(name) or self.defined.get(name, ()))


def env_reads(root: pathlib.Path = ROOT) -> EnvScan:
  """The environment variables the package reads, from its source.

  A variable counts as read where ``os.environ.get/pop/setdefault(X)``, ``os.environ[X]``,
  ``X in os.environ`` or ``os.getenv(X)`` names it, X being a string or a module-level constant
  of the package (``PAGED_ENV = "AREAL_JAX_PAGED_CACHE"``, also through ``module.PAGED_ENV``);
  and every ``"AREAL_JAX_..."`` string constant counts, since the package defines its own names
  only to read them (some through a function's parameter, ``_requested(requested, env)``). A read
  through anything else is reported in ``unresolved``, except a parameter of the enclosing
  function (its callers pass the constants)."""
  files = [p for s in SCANNED for p in ([root / s] if (root / s).is_file()
                                          else sorted((root / s).rglob("*.py")))
           if str(p.relative_to(root)) != REGISTRY_FILE]
  trees = {str(p.relative_to(root)): ast.parse(p.read_text(), str(p)) for p in files}
  constants: dict[str, set[str]] = {}
  for tree in trees.values():
    for stmt in tree.body:
      if (isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant)
          and isinstance(stmt.value.value, str)):
        for target in stmt.targets:
          if isinstance(target, ast.Name):
            constants.setdefault(target.id, set()).add(stmt.value.value)
  scan = EnvScan({}, {}, [], {})
  for name, tree in trees.items():
    _ReadFinder(name, constants, scan).visit(tree)
    for node in ast.walk(tree):
      if isinstance(node, ast.Constant) and isinstance(node.value, str) and OWN_NAME.fullmatch(node.value):
        scan.defined.setdefault(node.value, set()).add(name)
    for match in OWN_NAME.finditer((root / name).read_text()):
      scan.mentions.setdefault(match.group(), set()).add(name)
  return scan


def _is_environ(node: ast.expr) -> bool:
  return ((isinstance(node, ast.Attribute) and node.attr == "environ"
           and isinstance(node.value, ast.Name) and node.value.id == "os")
          or (isinstance(node, ast.Name) and node.id == "environ"))


class _ReadFinder(ast.NodeVisitor):

  def __init__(self, file: str, constants: dict[str, set[str]], scan: EnvScan):
    self.file, self.constants, self.scan, self.params = file, constants, scan, [set()]

  def visit_FunctionDef(self, node):  # noqa: N802
    a = node.args
    self.params.append({p.arg for p in a.posonlyargs + a.args + a.kwonlyargs})
    self.generic_visit(node)
    self.params.pop()

  visit_AsyncFunctionDef = visit_FunctionDef  # noqa: N815

  def visit_Call(self, node):  # noqa: N802
    f = node.func
    if node.args and isinstance(f, ast.Attribute) and (
        (f.attr in ("get", "pop", "setdefault") and _is_environ(f.value))
        or (f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os")):
      self._read(node.args[0])
    self.generic_visit(node)

  def visit_Subscript(self, node):  # noqa: N802
    if isinstance(node.ctx, ast.Load) and _is_environ(node.value):
      self._read(node.slice)
    self.generic_visit(node)

  def visit_Compare(self, node):  # noqa: N802
    if (len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn))
        and _is_environ(node.comparators[0])):
      self._read(node.left)
    self.generic_visit(node)

  def _read(self, arg: ast.expr) -> None:
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
      names = {arg.value}
    elif isinstance(arg, ast.Name) and arg.id in self.params[-1]:
      return  # a parameter: the callers name the variable
    elif isinstance(arg, (ast.Name, ast.Attribute)):
      names = self.constants.get(arg.id if isinstance(arg, ast.Name) else arg.attr, set())
    else:
      names = set()
    if not names:
      self.scan.unresolved.append(f"{self.file}:{arg.lineno}")
    for name in names:
      self.scan.reads.setdefault(name, set()).add(self.file)


# ---------------------------------------------------------------------------------------------
# Config files and presets.


@dataclasses.dataclass(frozen=True)
class ConfigFile:
  path: str
  title: str  # the docstring's first line
  presets: tuple[str, ...]


def config_files(root: pathlib.Path = ROOT) -> list[ConfigFile]:
  """Every ``configs/*.py`` with its presets: the module's ``PRESETS`` where it defines them,
  else the list its ``get_config`` gives when asked for an unknown preset."""
  out = []
  for path in sorted((root / "configs").glob("*.py")):
    spec = importlib.util.spec_from_file_location(f"_reference_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    presets = tuple(getattr(module, "PRESETS", ()))
    if not presets:
      try:
        module.get_config("\0")
      except ValueError as e:
        presets = tuple(p.strip() for p in str(e).rsplit(": ", 1)[-1].split(","))
    doc = (module.__doc__ or "").strip()
    rel = str(path.relative_to(root))
    out.append(ConfigFile(rel, doc.splitlines()[0] if doc else "", presets))
  return out


# ---------------------------------------------------------------------------------------------
# The page.


def _text(s: str) -> str:
  """Plain text for a Markdown table cell or paragraph: every character Markdown (or MyST's
  dollar math) would read as markup is escaped."""
  return re.sub(r"([\\`*_\[\]<>|$~])", r"\\\1", s)


def _code(s: str) -> str:
  return "`" + s.replace("|", "\\|") + "`"


def _row(*cells: str) -> str:
  return "| " + " | ".join(cells) + " |"


INTRO = f"""\
% Generated from the code: do not edit by hand. After changing a key's comment in
% areal_jax/config.py, a config file or areal_jax/env_vars.py, regenerate it with
%   {COMMAND}
% (tests/test_config_reference.py fails while it is out of date).

# Configuration reference

A run is configured by a Python file under `configs/` whose `get_config(preset)` starts from
`base_config()` (`areal_jax/config.py`), changes what the task needs and locks the tree. The
command line picks the file and a preset, and may override any key with its dotted name:

```
python launch.py --config=configs/gsm8k.py:tiny --workdir=/tmp/gsm8k_tiny \\
    --config.rollout.n_samples=8 --config.actor.lr=2e-5
```

An override must name an existing key (a misspelt one fails with the nearest valid names) and
give a value of the key's type; `validate` then checks the combination before any model loads
and reports every inconsistent setting with the keys involved. `python -m areal_jax.evaluate`,
`python -m areal_jax.serve` and `python -m areal_jax.export` take the same `--config` flags.
Inside Python, `areal_jax.config.load("configs/gsm8k.py:tiny")` returns the same tree.

This page is generated from the code: the meaning of each key is its comment in
`areal_jax/config.py`, and the environment variables come from `areal_jax/env_vars.py`.
"""


def render() -> str:
  """The whole page."""
  out = [INTRO]
  files = config_files()
  out += ["## Config files and presets", "",
          "Pick one with `--config=<file>:<preset>`; without a preset, `default`.", "",
          _row("File", "Presets", "What it runs"), _row("---", "---", "---")]
  for f in files:
    out.append(_row(_code(f.path), ", ".join(_code(p) for p in f.presets), _text(f.title)))
  all_keys, groups = keys(), nodes()
  sections = [k for k in groups if "." not in k]
  out += ["", "## Keys", "",
          f"The base config has {len(all_keys)} keys in {len(sections) + 1} sections. Types are "
          "checked: an override of an `int` key with `0.5` fails, while an `int` value is "
          "accepted for a `float` key.", ""]
  by_section: dict[str, list[Key]] = {}
  for k in all_keys:
    by_section.setdefault(k.name.split(".")[0] if "." in k.name else "", []).append(k)
  for section in [""] + sections:
    title = f"`{section}`" if section else "Top-level keys"
    out += [f"### {title}", ""]
    if section:
      out += [_text(groups[section]), ""]
    subgroups = [g for g in groups if g.startswith(f"{section}.")] if section else []
    for g in subgroups:
      out.append(f"- {_code(g)}: {_text(groups[g])}")
    if subgroups:
      out.append("")
    out += [_row("Key", "Type", "Default", "Meaning"), _row("---", "---", "---", "---")]
    rows = by_section.get(section, [])
    for k in rows:
      more = " (more below)" if k.detail else ""
      out.append(_row(_code(k.name), k.type, _code(_literal(k.default)), _text(k.summary) + more))
    details = [k for k in rows if k.detail]
    if details:
      out += ["", "More on some of them:", ""]
      out += [f"- {_code(k.name)}: {_text(k.detail)}" for k in details]
    out.append("")
  out += _render_env()
  return "\n".join(out).rstrip("\n") + "\n"


_KIND_TEXT = {
    env_vars.OVERRIDE: ("Kernel overrides",
                        "Each forces, process-wide, a choice the config leaves to the platform "
                        "(`\"auto\"`); set it before the process builds its engines. Benchmarks "
                        "(`bench/`) and tests use them to compare kernels; a run is better "
                        "configured through the keys named."),
    env_vars.INTERNAL: ("Set by the package for its own processes",
                        "Listed so that they are known; not to be set by hand."),
    env_vars.EXTERNAL: ("Other programs' variables",
                        "Standard variables of other programs (JAX and XLA, Python, CUDA, the C++ "
                        "compiler, OpenAI's client) that the package also reads."),
}


def _render_env() -> list[str]:
  scan = env_reads()
  registry = env_vars.REGISTRY
  out = ["## Environment variables", "",
         f"The package reads {len(registry)} environment variables (`areal_jax/env_vars.py`); "
         "configuration otherwise lives in the keys above.", ""]
  for kind in env_vars.KINDS:
    rows = [v for v in registry.values() if v.kind == kind]
    title, text = _KIND_TEXT[kind]
    out += [f"### {title}", "", text, "",
            _row("Variable", "Values", "Meaning", "Read in"), _row("---", "---", "---", "---")]
    for v in rows:
      where = ", ".join(_code(f) for f in scan.where(v.name))
      out.append(_row(_code(v.name), _text(v.values), _text(v.meaning), where))
    out.append("")
  return out


def main() -> None:
  sys.stdout.write(render())


if __name__ == "__main__":
  main()
