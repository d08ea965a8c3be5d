"""Every command line, link and repository path in README.md and docs/**/*.md is valid.

Nothing is run: a command line is checked the way its program would read it, so a renamed config
key, preset, flag, module, make target or file breaks a test that names the page and line.

* ``python launch.py`` / ``python -m areal_jax.<module>`` / ``python <script>.py``: the module or
  script exists; ``--config=<file>[:<preset>]`` loads through ``areal_jax.config.load``; every
  ``--config.a.b=v`` names a key of that config and ``v`` parses to the key's type (ml_collections'
  own override parsing, as on the command line); every other ``--flag`` is one the program defines
  (its absl ``DEFINE_*`` or argparse ``add_argument`` calls, read from its source without running it,
  plus absl's own flags).
* ``make <target>``: the Makefile has the target. ``bash <script>``: the script exists.
* Placeholders (``<dir>``, ``$HOME/...``, ``...``) are not checked as values; the key or flag
  before them still must exist. ``[--flag=v]`` and ``file.py[:preset]`` (optional parts) are
  checked with and without the part.

Commands are read from fenced blocks of shell languages (bash, sh, shell, console, text, none) and
from inline code that starts with ``python``, ``make``, ``bash`` or a repository script.
Links ``[..](path)`` and backticked repository paths (``areal_jax/x.py``, ``bench/results/x/``)
must exist inside the repository; nothing may point outside it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import os
import pathlib
import re
import shlex
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MIN_COMMANDS = 20  # an empty parse (a changed fence syntax, a moved page) must fail

SHELL_LANGS = {"", "bash", "sh", "shell", "console", "text", "none", "shell-session", "zsh"}
PYTHON = re.compile(r"^(?:.*/)?python(?:3(?:\.\d+)?)?$")
ENV_ASSIGN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PLACEHOLDER = re.compile(r"<[^>]*>|\$|\.\.\.|…|\{|\}")
# absl's own flags (absl.app's help flags, absl.logging's), accepted by every absl program
ABSL_FLAGS = {"help", "helpfull", "helpshort", "helpxml", "flagfile", "undefok", "v", "verbosity",
              "only_check_args", "pdb", "pdb_post_mortem", "profile_file", "run_with_pdb",
              "run_with_profiling", "use_cprofile_for_profiling", "alsologtostderr", "log_dir",
              "logger_levels", "logtostderr", "showprefixforinfo", "stderrthreshold"}


def doc_files() -> list[pathlib.Path]:
  files = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
  return [f for f in files if f.is_file() and "_build" not in f.relative_to(ROOT).parts]


@functools.cache
def repo_top_level() -> frozenset[str]:
  """The names at the repository's top (tracked, plus what exists): the first part of a path that
  is the repository's own (``runs/demo/curves.png``, ``/tmp/run`` are a run's, not checked)."""
  try:
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
  except (OSError, subprocess.CalledProcessError):
    tracked = []
  names = {p.split("/")[0] for p in tracked}
  names |= {"areal_jax", "bench", "colabs", "configs", "docs", "launch", "tests", "launch.py",
            "Makefile", "README.md", "pyproject.toml"}
  return frozenset(n for n in names if n != ".git")


@functools.cache
def package_dirs() -> frozenset[str]:
  """areal_jax's subpackages: ``runtime/engines.py`` on a page means ``areal_jax/runtime/engines.py``."""
  return frozenset(p.name for p in (ROOT / "areal_jax").iterdir() if (p / "__init__.py").is_file())


def is_repo_path(word: str) -> bool:
  """A word that names a file of the repository (its first part is the repository's)."""
  return ("/" in word and re.search(r"\.[A-Za-z]\w*$", word) is not None and not is_placeholder(word)
          and word.removeprefix("./").split("/")[0] in repo_top_level())


# --- reading the pages -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Command:
  file: str  # relative to ROOT
  line: int
  text: str

  @property
  def id(self) -> str:
    return f"{self.file}:{self.line}"


FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*(.*)$")


def fence_lang(info: str) -> str:
  """A fence's language: ``bash`` for ```bash and ```{code-block} bash; ``{name} arg`` for another
  MyST directive (``{note}``, ``{image} x.png``, ``{toctree}``)."""
  info = info.strip()
  m = re.match(r"^\{(?:code-block|code|sourcecode)\}\s*(\S*)", info)
  if m:
    return m.group(1).lower()
  if info.startswith("{"):
    return info
  return info.split()[0].lower() if info else ""


def split_blocks(text: str):
  """Yields ("fence", lang, first_line, lines) and ("prose", None, first_line, lines)."""
  lines = text.splitlines()
  i, prose_start, prose = 0, 1, []
  while i < len(lines):
    m = FENCE.match(lines[i])
    if not m:
      prose.append(lines[i])
      i += 1
      continue
    if prose:
      yield "prose", None, prose_start, prose
    marker, lang = m.group(2), fence_lang(m.group(3))
    body, start = [], i + 2
    i += 1
    while i < len(lines) and not re.match(rf"^\s*{re.escape(marker[0])}{{{len(marker)},}}\s*$",
                                          lines[i]):
      body.append(lines[i])
      i += 1
    yield "fence", lang, start, body
    i += 1
    prose, prose_start = [], i + 1
  if prose:
    yield "prose", None, prose_start, prose


def logical_lines(body: list[str], start: int, console: bool):
  """Shell lines with their continuations joined; ``$ `` prompts stripped (console: only the
  prompted lines are commands)."""
  prompted = console and any(l.lstrip().startswith("$ ") for l in body)
  i = 0
  while i < len(body):
    line, first = body[i], start + i
    if prompted:
      if not line.lstrip().startswith("$ "):
        i += 1
        continue
    line = re.sub(r"^\s*\$ ", "", line)
    while line.rstrip().endswith("\\") and i + 1 < len(body):
      i += 1
      line = line.rstrip()[:-1] + " " + body[i].strip()
    i += 1
    if line.strip():
      yield first, line.strip()


INLINE = re.compile(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)*)`(?!`)")


def is_command_start(words: list[str]) -> bool:
  while words and ENV_ASSIGN.match(words[0]):
    words = words[1:]
  if not words:
    return False
  head = words[0]
  if PYTHON.match(head) or head in ("make", "bash"):
    return True
  # a repository script with flags: `bench/async_vs_sync.py --mode=ray`
  return (len(words) > 1 and re.match(r"^(?:\./)?[\w./-]+\.(?:py|sh)$", head) is not None
          and head.lstrip("./").split("/")[0] in repo_top_level())


# MyST directives whose body is Markdown (read as the page is), and those whose argument is a file
PROSE_DIRECTIVES = {"note", "warning", "tip", "important", "seealso", "caution", "attention", "danger",
                    "error", "hint", "admonition", "dropdown", "topic", "sidebar", "margin"}
FILE_DIRECTIVES = {"image", "figure", "include", "literalinclude"}


def page_items(path: pathlib.Path):
  """(commands, inline code spans, links) of one page, each with its line."""
  rel = str(path.relative_to(ROOT))
  commands, spans, links = [], [], []
  read_markdown(rel, path.read_text(encoding="utf-8").splitlines(), 0, commands, spans, links)
  return commands, spans, links


def read_markdown(rel, lines, offset, commands, spans, links):
  """Collects what ``lines`` (the page's from line ``offset + 1`` on) hold."""
  for kind, lang, start, body in split_blocks("\n".join(lines)):
    start += offset
    if kind == "fence" and lang.startswith("{"):
      name, _, arg = lang[1:].partition("}")
      name, arg = name.strip(), arg.strip()
      if name in PROSE_DIRECTIVES:
        read_markdown(rel, body, start - 1, commands, spans, links)
      elif name in FILE_DIRECTIVES and arg:
        links.append((start - 1, arg))
      elif name == "toctree":  # entries are pages without their extension, or "Title <page>"
        for n, entry in enumerate(body):
          entry = entry.strip()
          m = re.match(r"^.*<([^>]+)>$", entry)
          entry = m.group(1) if m else entry
          if entry and not entry.startswith(":") and entry != "self" and "*" not in entry and \
              "://" not in entry:
            base = (ROOT / rel).parent
            ext = next((e for e in (".md", ".ipynb", ".rst") if (base / (entry + e)).is_file()), ".md")
            links.append((start + n, entry + ext))
      continue
    if kind == "fence":
      if lang in SHELL_LANGS:
        for line, cmd in logical_lines(body, start, console=lang in ("console", "shell-session")):
          commands.append(Command(rel, line, cmd))
      continue
    chunk = "\n".join(body)
    for m in INLINE.finditer(chunk):
      line = start + chunk.count("\n", 0, m.start())
      span = " ".join(m.group(1).split())
      try:
        words = shlex.split(span)
      except ValueError:
        words = span.split()
      if is_command_start(words):
        commands.append(Command(rel, line, span))
      else:
        spans.append((line, m.group(1).strip()))
    prose_only = INLINE.sub(lambda m: " " * len(m.group(0)), chunk)  # no links inside code
    for m in re.finditer(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"
                         r"|^\s*\[[^\]]+\]:\s*(\S+)|\bsrc=\"([^\"]+)\"", prose_only, re.M):
      line = start + prose_only.count("\n", 0, m.start())
      links.append((line, next(g for g in m.groups() if g)))


@functools.cache
def all_items():
  commands, spans, links, texts = [], [], [], []
  for f in doc_files():
    c, s, l = page_items(f)
    rel = str(f.relative_to(ROOT))
    commands += c
    spans += [(rel, line, span) for line, span in s]
    links += [(rel, line, link) for line, link in l]
  return commands, spans, links


# --- what the programs accept ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ProgramFlags:
  names: frozenset  # "--x" and "-x" spellings the program accepts
  config_flags: frozenset  # DEFINE_config_file names: --name.a.b=v overrides
  absl: bool


@functools.cache
def program_flags(source: pathlib.Path) -> ProgramFlags:
  """The flags a program defines, read from its source's DEFINE_* and add_argument calls."""
  tree = ast.parse(source.read_text(encoding="utf-8"))
  names, configs, absl = set(), set(), False
  for node in ast.walk(tree):
    if not isinstance(node, ast.Call):
      continue
    fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
    strings = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
    kw = {k.arg: k.value.value for k in node.keywords
          if isinstance(k.value, ast.Constant) and isinstance(k.value.value, str)}
    if fn.startswith("DEFINE_"):
      absl = True
      name = kw.get("name") or (strings[0] if strings else None)
      if not name:
        continue
      names.add(f"--{name}")
      if fn in ("DEFINE_bool", "DEFINE_boolean"):
        names.add(f"--no{name}")
      if fn in ("DEFINE_config_file", "DEFINE_config_dict", "DEFINE_config_dataclass"):
        configs.add(name)
    elif fn == "add_argument":
      names.update(s for s in strings if s.startswith("-"))
  if absl:
    names.update(f"--{n}" for n in ABSL_FLAGS)
    names.update({"--nologtostderr", "--noalsologtostderr", "-v"})
  return ProgramFlags(frozenset(names), frozenset(configs), absl)


@functools.cache
def make_targets() -> frozenset[str]:
  targets = set()
  for line in (ROOT / "Makefile").read_text(encoding="utf-8").splitlines():
    m = re.match(r"^([A-Za-z0-9_.%/ -]+?)\s*::?(?!=)", line)
    if m and not line.startswith("\t"):
      targets.update(t for t in m.group(1).split() if "$" not in t)
  return frozenset(targets)


@functools.cache
def load_config(spec: str):
  """``areal_jax.config.load`` on a page's ``file.py[:preset]`` (relative to the repository)."""
  from areal_jax import config as config_lib
  path, sep, preset = spec.partition(":")
  return config_lib.load(str(ROOT / path) + sep + preset)


def parse_overrides(spec: str, overrides: tuple[str, ...]) -> None:
  """The overrides applied as ``--config`` applies them (ml_collections' parsers, the key's type)."""
  from absl import flags
  from ml_collections import config_flags
  path, sep, preset = spec.partition(":")
  argv = ["prog", f"--config={ROOT / path}{sep}{preset}", *overrides]
  fv = flags.FlagValues()
  # sys_argv: where ml_collections finds the overrides to define as flags (sys.argv by default)
  config_flags.DEFINE_config_file("config", None, "", flag_values=fv, sys_argv=argv)
  fv(argv)
  fv["config"].value  # pylint: disable=pointless-statement  (applies the overrides)


def is_placeholder(value: str) -> bool:
  return bool(PLACEHOLDER.search(value)) or value in ("", "path/to/config.py") or \
      value.startswith("path/to")


def variants(words: list[str]) -> list[list[str]]:
  """A command's words with optional parts: ``[--merged=x]`` both kept and dropped,
  ``file.py[:preset]`` with and without the preset."""
  out = [[]]
  for w in words:
    if w.startswith("[") and w.endswith("]") and w[1:2] == "-":
      out = [o + [w[1:-1]] for o in out] + out
      continue
    m = re.match(r"^(.*?)\[([^\]]+)\](.*)$", w)
    if m and not m.group(1).endswith(".") and "=" in m.group(1):
      out = [o + [m.group(1) + m.group(2) + m.group(3)] for o in out] + \
            [o + [m.group(1) + m.group(3)] for o in out]
      continue
    out = [o + [w] for o in out]
  return out


def check_config_key(config, key: str) -> str | None:
  from ml_collections import ConfigDict
  node = config
  for part in key.split("."):
    if not isinstance(node, ConfigDict) or part not in node.keys():
      keys = sorted(node.keys()) if isinstance(node, ConfigDict) else []
      return f"unknown config key {key!r} (at {part!r}; valid there: {', '.join(keys)})"
    node = node[part]
  return None


def check_program(source: pathlib.Path, args: list[str], own: bool) -> list[str]:
  """The flags of a repository program (``own``); the config file, keys and values it is given."""
  errors = []
  pf = program_flags(source) if own else None
  spec_of = {}  # config flag -> its file[:preset]
  overrides = {}  # config flag -> [(arg, key, value)]
  i = 0
  while i < len(args):
    arg = args[i]
    i += 1
    if not arg.startswith("-") or arg in ("-", "--"):
      continue
    name, eq, value = arg.partition("=")
    if not eq and i < len(args) and not args[i].startswith("-"):
      value, eq = args[i], "="  # "--flag value" (or a bool flag and a positional: harmless)
    cfg = next((c for c in (pf.config_flags if pf else ()) if name.startswith(f"--{c}.")), None)
    if cfg:
      overrides.setdefault(cfg, []).append((arg, name[len(cfg) + 3:], value))
      continue
    if pf is not None and name not in pf.names:
      errors.append(f"{source.relative_to(ROOT)} defines no flag {name}")
      continue
    if eq and (name == "--config" or name.endswith("_config")) and (
        ".py" in value or is_placeholder(value)):
      spec_of[name[2:]] = value
  for flag, spec in spec_of.items():
    if is_placeholder(spec):
      continue
    try:
      load_config(spec)
    except FileNotFoundError:
      errors.append(f"--{flag}={spec}: no such config file")
    except Exception as e:  # pylint: disable=broad-except  (an unknown preset, a broken file)
      errors.append(f"--{flag}={spec}: {type(e).__name__}: {e}")
  for flag, items in overrides.items():
    spec = spec_of.get(flag)
    if spec is None:
      errors.append(f"--{flag}.* overrides without --{flag}=")
      continue
    if any(e.startswith(f"--{flag}=") for e in errors):
      continue
    if is_placeholder(spec):
      from areal_jax import config as config_lib
      config = config_lib.base_config()  # the keys every config has
    else:
      config = load_config(spec)
    concrete = []
    for arg, key, value in items:
      problem = check_config_key(config, key)
      if problem:
        errors.append(f"{arg}: {problem}")
      elif not is_placeholder(value):
        concrete.append(f"--config.{key}={value}")
    if concrete and not is_placeholder(spec) and not any("unknown config key" in e for e in errors):
      try:
        parse_overrides(spec, tuple(concrete))
      except Exception as e:  # pylint: disable=broad-except  (a value of the wrong type)
        errors.append(f"overrides {concrete}: {type(e).__name__}: {e}")
  return errors


def module_source(module: str) -> pathlib.Path | None:
  """The file ``python -m module`` runs, when it is the repository's own."""
  spec = importlib.util.find_spec(module)
  origin = pathlib.Path(spec.origin) if spec and spec.origin else None
  if spec and spec.submodule_search_locations:  # a package: its __main__
    origin = pathlib.Path(list(spec.submodule_search_locations)[0]) / "__main__.py"
  if origin and origin.is_file() and ROOT in origin.resolve().parents:
    return origin
  return None


def split_shell(text: str) -> list[list[str]]:
  """A shell line's simple commands (split at && || ; |), comments dropped."""
  try:
    words = shlex.split(text, comments=True)
  except ValueError:
    words = text.split("#")[0].split()
  parts, cur, redirect = [], [], False
  for w in words:
    if redirect:  # the file of a redirection: a command's output, not its argument
      redirect = False
      continue
    if re.match(r"^(?:\d?>>?|<|&>)(&\d)?$", w):
      redirect = not w.endswith(("&1", "&2"))
      continue
    if re.match(r"^\d?>>?&?\S+$", w) and not w.startswith("-"):  # 2>/dev/null, >out.txt
      continue
    if w in ("&&", "||", ";", "|", "&"):
      parts.append(cur)
      cur = []
    elif w.endswith(";") and len(w) > 1:
      cur.append(w[:-1])
      parts.append(cur)
      cur = []
    else:
      cur.append(w)
  parts.append(cur)
  return [p for p in parts if p]


def strip_prefix(words: list[str]) -> list[str]:
  """Drops ``VAR=value`` assignments and the wrappers that run a command (env, time, nohup)."""
  while words:
    if ENV_ASSIGN.match(words[0]) or words[0] in ("env", "time", "nohup", "exec"):
      words = words[1:]
    elif words[0] == "/usr/bin/time":
      words = [w for w in words[1:] if not w.startswith("-")] if len(words) > 1 else []
      words = words if words else []
    else:
      break
  return words


def command_kind(words: list[str]) -> str | None:
  """"python", "make", "bash" or "script" when the command is one this test checks, else None."""
  words = strip_prefix(words)
  if not words:
    return None
  head = words[0]
  if PYTHON.match(head):
    rest = words[1:]
    if not rest or rest[0] == "-c" or rest[0].startswith("-") and rest[0] != "-m":
      return None
    return "python"
  if head == "make":
    return "make"
  if head in ("bash", "sh"):
    return "bash" if len(words) > 1 and not words[1].startswith("-") else None
  if re.match(r"^(?:\./)?[\w./-]+\.(?:py|sh)$", head) and \
      head.lstrip("./").split("/")[0] in repo_top_level():
    return "script"
  return None


def check_words(words: list[str]) -> list[str]:
  words = strip_prefix(words)
  missing = [f"no such file {w}" for w in words[1:]
             if not w.startswith("-") and is_repo_path(w) and not (ROOT / w).exists()]
  return missing + [e for e in check_kind(words) if e not in missing]


def check_kind(words: list[str]) -> list[str]:
  kind = command_kind(words)
  head, rest = words[0], words[1:]
  if kind == "make":
    errors = []
    for w in rest:
      if w.startswith("-") or "=" in w:
        continue
      if w not in make_targets():
        errors.append(f"the Makefile has no target {w!r}")
    return errors
  if kind == "bash":
    script = rest[0]
    if is_placeholder(script):
      return []
    return [] if (ROOT / script).is_file() else [f"no such script {script}"]
  if kind == "script":
    script = ROOT / head.lstrip("./")
    if not script.is_file():
      return [f"no such script {head}"]
    return check_program(script, rest, own=script.suffix == ".py")
  # python
  if rest[0] == "-m":
    if len(rest) < 2:
      return ["python -m without a module"]
    module = rest[1]
    try:
      found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
      found = False
    if not found:
      return [f"no module {module}"]
    source = module_source(module)
    return check_program(source, rest[2:], own=True) if source else []
  script = rest[0]
  if is_placeholder(script):
    return []
  path = ROOT / script
  if not path.is_file():
    return [f"no such file {script}"]
  return check_program(path, rest[1:], own=path.suffix == ".py")


def checked_commands() -> list[tuple[Command, list[list[str]]]]:
  """The commands this test checks, each with its simple commands (words)."""
  out = []
  for cmd in all_items()[0]:
    parts = [p for p in split_shell(cmd.text) if command_kind(p)]
    if parts:
      out.append((cmd, parts))
  return out


COMMANDS = checked_commands()


def test_the_pages_have_command_lines():
  files = {c.file for c, _ in COMMANDS}
  print(f"\n{len(COMMANDS)} command lines on {len(files)} pages "
        f"({len(doc_files())} pages read): {sorted(files)}")
  assert len(COMMANDS) >= MIN_COMMANDS, (
      f"only {len(COMMANDS)} command lines found in README.md and docs/**/*.md")


@pytest.mark.parametrize("cmd,parts", COMMANDS, ids=[c.id for c, _ in COMMANDS])
def test_command_line_is_valid(cmd, parts):
  errors = []
  for words in parts:
    for variant in variants(words):
      errors += [e for e in check_words(variant) if e not in errors]
  assert not errors, f"{cmd.id}: {cmd.text}\n  " + "\n  ".join(errors)


# --- links and paths ---------------------------------------------------------------------------

PATH_SPAN = re.compile(r"^(?:\.{1,2}/)?[\w.@+-]+(?:/[\w.@+-]+)*/?(?::[\w.:]+)?$")


def repo_path_problem(page: str, target: str, is_link: bool) -> str | None:
  """Why ``target`` (a link, or a path in backticks) on ``page`` is not a file or folder inside
  the repository; None when it is, or when it is no repository path."""
  base = (ROOT / page).parent
  if is_link:
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
      return None  # a URL (https:, mailto:), an anchor on the same page
    target = target.split("#")[0].split("?")[0]
    if not target:
      return None
    resolved = (ROOT / target.lstrip("/")) if target.startswith("/") else base / target
  else:
    target = re.sub(r":[\w.:]*$", "", target)  # areal_jax/x.py:func, tests/x.py::test
    if target.startswith(("/", "~")):
      return "outside the repository" if "shared" in target.split("/") else None
    if target.startswith("../") or target.startswith("./"):
      resolved = base / target
    elif target.split("/")[0] in repo_top_level():
      resolved = ROOT / target
    elif target.split("/")[0] in package_dirs():
      resolved = ROOT / "areal_jax" / target
    else:
      return None  # a run's path (runs/demo/curves.png), a package's, ...
  resolved = pathlib.Path(os.path.normpath(resolved))
  if resolved != ROOT and ROOT not in resolved.parents:
    return "outside the repository"
  return None if resolved.exists() else "no such file or directory"


def link_items():
  _, spans, links = all_items()
  items = [(page, line, target, True) for page, line, target in links]
  for page, line, span in spans:
    if ("/" in span and PATH_SPAN.match(span) and "://" not in span
        and (span.endswith("/") or re.search(r"\.[A-Za-z]\w*(?::[\w.:]+)?$", span))
        and not is_placeholder(span) and "*" not in span):
      items.append((page, line, span, False))
  return items


LINKS = link_items()


@pytest.mark.parametrize("page,line,target,is_link", LINKS,
                         ids=[f"{p}:{l}:{t}" for p, l, t, _ in LINKS])
def test_link_or_path_exists_in_the_repository(page, line, target, is_link):
  problem = repo_path_problem(page, target, is_link)
  assert problem is None, f"{page}:{line}: {target}: {problem}"


def test_no_page_points_outside_the_repository():
  found = []
  for f in doc_files():
    for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
      if re.search(r"\.\./shared\b|/work/shared|shared/REFERENCE\.md", line):
        found.append(f"{f.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
  assert not found, "pages that point outside the repository:\n" + "\n".join(found)


# --- the checks themselves ---------------------------------------------------------------------

BROKEN = [
    ("python launch.py --config=configs/arithmetic.py:nosuch --workdir=/tmp/x", "nosuch"),
    ("python launch.py --config=configs/nosuch.py --workdir=/tmp/x", "no such config file"),
    ("python launch.py --config=configs/arithmetic.py --config.actor.lrr=1e-5", "unknown config key"),
    ("python launch.py --config=configs/arithmetic.py --config.actor.lrr=<lr>", "unknown config key"),
    ("python launch.py --config=... --config.rolout.n_samples=4", "unknown config key"),
    ("python launch.py --config=configs/arithmetic.py --config.actor.lr=fast", "actor.lr"),
    ("python launch.py --config=configs/arithmetic.py --workdir=/tmp/x --resume", "no flag --resume"),
    ("python -m areal_jax.nosuch --x=1", "no module"),
    ("python -m areal_jax.evaluate --config=configs/arithmetic.py --chekpoint=x", "no flag --chekpoint"),
    ("python bench/sampler.py --no-such-flag", "no flag --no-such-flag"),
    ("make nosuch", "no target"),
    ("bash launch/nosuch.sh", "no such script"),
    ("cd /tmp && python launch.py --config=configs/gsm8k.py:tiny --config.train.total_stepz=2", "unknown"),
    ("python -m areal_jax.export --config=configs/gsm8k.py:tiny [--mergd=x]", "no flag --mergd"),
    ("python -m pytest -q tests/test_nosuch.py", "no such file tests/test_nosuch.py"),
    ("python launch.py --config=configs/gsm8k.py:tiny --config.train.total_steps three", "total_steps"),
]
VALID = [
    "python launch.py --config=configs/arithmetic.py:tiny --workdir=/tmp/x --config.actor.lr=1e-4 "
    "--config.rollout.prefill_buckets=(64,128) --config.mesh.colocated=False --verbosity=1",
    "XLA_FLAGS=--xla_force_host_platform_device_count=4 .venv/bin/python -m areal_jax.evaluate "
    "--config=configs/gsm8k.py:tiny --checkpoint=<workdir> --config.train.eval_size=$N",
    "python -m areal_jax.serve.demo --config=configs/serve_arithmetic.py[:thread] --workdir=...",
    "make install ACCEL=tpu && make demo",
    "python launch.py --config=configs/gsm8k.py:tiny --config.train.total_steps 3 --workdir /tmp/x",
    "python -m areal_jax.generate --n=2 > docs/generated_page.md 2>&1",
]


@pytest.mark.parametrize("text,expected", BROKEN, ids=[t for t, _ in BROKEN])
def test_the_check_finds_a_broken_command(text, expected):
  errors = [e for words in split_shell(text) if command_kind(words)
            for v in variants(words) for e in check_words(v)]
  assert any(expected in e for e in errors), errors


@pytest.mark.parametrize("text", VALID)
def test_the_check_passes_a_valid_command(text):
  parts = [p for p in split_shell(text) if command_kind(p)]
  assert parts
  assert not [e for words in parts for v in variants(words) for e in check_words(v)]


def test_the_check_finds_a_link_outside_the_repository():
  assert repo_path_problem("README.md", "../shared/REFERENCE.md", True) == "outside the repository"
  assert repo_path_problem("README.md", "docs/nosuch.md#x", True) == "no such file or directory"
  assert repo_path_problem("README.md", "areal_jax/nosuch.py:f", False) == "no such file or directory"
  assert repo_path_problem("README.md", "areal_jax/config.py:load", False) is None
  assert repo_path_problem("README.md", "runs/demo/curves.png", False) is None  # a run's output
  assert repo_path_problem("README.md", "runtime/nosuch.py:X", False) == "no such file or directory"
  assert repo_path_problem("README.md", "runtime/engines.py:MergingEngine", False) is None
