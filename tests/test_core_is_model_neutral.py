"""The core names no model library, read from its source (``ast``): what it knows of Hugging Face,
PEFT, accelerate, DeepSpeed or Liger is registered from ``tiled_mlp.integrations``, and its messages
name its own functions, not the facade's.

Scanned in every ``tiled_core/**/*.py``: imports, identifiers (names, attributes, definitions,
arguments, keywords) and string constants (messages, code-form bodies, lookup keys). Docstrings and
comments are prose about the code's surroundings and are not scanned. A library's forward body names
no library (``self.down_proj(self.act_fn(...))``), so each ``CodeForm`` body written in the core must
be the forward of one of torch's own ``nn`` modules.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterator, List, Set, Tuple

from torch import nn

from tiled_mlp.core.code_forms import CodeForm, same_code

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "tiled_core"

# Libraries, by the words they are named with in code, module paths and messages.
LIBRARIES = ("transformers", "peft", "accelerate", "deepspeed", "liger", "huggingface", "hugging face")
# Classes, functions and tables of those libraries that the core would only name to know about them.
LIBRARY_NAMES = ("LlamaMLP", "Phi3MLP", "FalconH1", "Llama4", "ACT2FN", "ACT2CLS", "SiLUActivation",
                 "GELUActivation", "PytorchGELUTanh", "zero3_linear_wrap", "LinearFunctionForZeroStage3",
                 "PreTrainedModel", "PretrainedConfig", "ForCausalLMLoss", "from_pretrained", "LoraLayer",
                 "UlyssesSPAttentionHF", "AlignDevicesHook")
# The facade's public functions and classes (``tiled_mlp``); those the core itself defines under the
# same name (``TiledMLP``, ``register_gated_mlp``) are the core's to name.
FACADE_NAMES = ("apply_tiled_mlp", "remove_tiled_mlp", "apply_tiled_loss", "remove_tiled_loss", "is_tiled_loss",
                "apply_long_context", "LongContextStack", "apply_checkpoint_offload", "apply_sequence_parallel",
                "SequenceParallel", "enable_tiled_mlp", "maybe_apply_tiled_mlp", "from_config", "TilingReport",
                "TiledBlock", "add_tiled_mlp_args", "read_tiled_mlp_flags", "apply_from_flags", "TiledMLPFlags")
FACADE_PATH = re.compile(r"\btiled_mlp\.(?!core\b|strategies\b)")  # the core and strategies install beneath it

_LIBRARY_WORD = re.compile(r"(?<![a-z0-9])(" + "|".join(re.escape(w) for w in LIBRARIES) + r")(?![a-z])", re.IGNORECASE)
_FACADE_WORD = re.compile(r"\b(" + "|".join(FACADE_NAMES) + r")\b")


def identifier_words(name: str) -> List[str]:
    """``use_liger`` -> [use, liger]; ``LigerGatedActivation`` -> [liger, gated, activation]."""
    return [w.lower() for part in name.split("_") for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+", part)]


def identifier_problem(name: str) -> str:
    words = identifier_words(name)
    library = next((lib for lib in LIBRARIES if " " not in lib and lib in words), None)
    if library:
        return f"names the library {library!r}"
    known = next((n for n in LIBRARY_NAMES if n in name), None)
    if known:
        return f"names {known!r}"
    if name in FACADE_NAMES:
        return f"names the facade's {name!r}"
    return ""


def string_problem(text: str) -> str:
    library = _LIBRARY_WORD.search(text)
    if library:
        return f"names the library {library.group(1)!r}"
    known = next((n for n in LIBRARY_NAMES if n in text), None)
    if known:
        return f"names {known!r}"
    facade = _FACADE_WORD.search(text) or FACADE_PATH.search(text)
    if facade:
        return f"names the facade ({facade.group(0)!r})"
    return ""


def _docstrings(tree: ast.AST) -> Set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found.add(id(first.value))
    return found


def _identifiers(node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, ast.Attribute):
        yield node.attr
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield node.name
    elif isinstance(node, ast.arg):
        yield node.arg
    elif isinstance(node, ast.keyword) and node.arg:
        yield node.arg
    elif isinstance(node, ast.alias) and node.asname:
        yield node.asname


def _imports(node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        # ``from x import LoraLayer`` names the class as well as the module
        yield from (f"{node.module or ''}.{alias.name}" for alias in node.names)


def violations(source: str, where: str) -> List[str]:
    """``where:line: what`` for every place ``source`` names a model library or the facade."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found: List[Tuple[int, str]] = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        for module in _imports(node):
            problem = identifier_problem(module.replace(".", "_").strip("_"))
            if problem:
                found.append((line, f"imports {module} ({problem})"))
        for name in _identifiers(node):
            problem = identifier_problem(name)
            if problem:
                found.append((line, f"identifier {name!r} {problem}"))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            problem = string_problem(node.value)
            if problem:
                text = node.value if len(node.value) <= 70 else node.value[:67] + "..."
                found.append((line, f"string {text!r} {problem}"))
    return [f"{where}:{line}: {what}" for line, what in sorted(set(found))]


def test_the_core_names_no_model_library_and_no_facade_function():
    found = [v for path in sorted(CORE.rglob("*.py"))
             for v in violations(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, ("tiled_core must hold no model library's knowledge; register it from tiled_mlp.integrations "
                       f"and name core functions in messages ({len(found)} places):\n" + "\n".join(found))


def _torch_forwards() -> List[object]:
    return [cls.forward for cls in vars(nn).values()
            if isinstance(cls, type) and issubclass(cls, nn.Module) and "forward" in vars(cls)]


def code_form_problems(source: str, where: str) -> List[str]:
    """``where:line: ...`` for each ``CodeForm(body)`` in ``source`` whose body is not the code of a
    forward of torch's ``nn`` modules."""
    forwards = _torch_forwards()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "CodeForm"):
            continue
        try:
            body = ast.literal_eval(node.args[0])
        except (ValueError, IndexError):
            found.append(f"{where}:{node.lineno}: a CodeForm whose body is not a literal")
            continue
        # The globals' names decide how the body compiles (``code_forms``); their values do not.
        names = node.args[1].keys if len(node.args) > 1 and isinstance(node.args[1], ast.Dict) else []
        form = CodeForm(body, {ast.literal_eval(name): None for name in names if name is not None})
        if not any(same_code(fn.__code__, form, fn.__doc__) for fn in forwards):
            found.append(f"{where}:{node.lineno}: CodeForm body {body!r} is no torch nn module's forward")
    return found


def test_the_cores_code_forms_are_torchs_own_forwards():
    found = [v for path in sorted(CORE.rglob("*.py"))
             for v in code_form_problems(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, ("tiled_core keeps only torch's own forward bodies; register a library's from "
                       "tiled_mlp.integrations:\n" + "\n".join(found))


def test_the_code_form_rule_catches_a_library_body():
    llama = 'X = CodeForm("return self.down_proj(self.act_fn(self.gate_proj({x})) * self.up_proj({x}))")'
    assert code_form_problems(llama, "core.py")
    assert code_form_problems("X = CodeForm(BODY)", "core.py")
    assert not code_form_problems('X = CodeForm("return F.linear({x}, self.weight, self.bias)", {"F": F})', "core.py")


def test_the_rule_catches_what_it_forbids():
    for bad in ("import transformers", "from deepspeed.runtime.zero.linear import x", "import liger_kernel.ops",
                "from peft.tuners.lora import LoraLayer", "x = ('deepspeed.runtime.zero.linear', 'zero3_linear_wrap')",
                "class TiledLlamaMLP: pass", "f(use_liger=True)", "class LigerGatedActivation: pass",
                "raise ValueError('run it untiled (remove_tiled_mlp / untile)')",
                "raise ValueError(f'declared with tiled_mlp.register_gated_mlp {x}')",
                "BODY = 'return nn.functional.silu(x)  # SiLUActivation'", "m = 'as Hugging Face does'",
                "from accelerate.hooks import AlignDevicesHook", "x = obj.ACT2FN"):
        assert violations(bad, "core.py"), bad
    for fine in ('"""Hugging Face and DeepSpeed named in a docstring are prose."""', "import torch",
                 "from .gated_forms import register_gated_form", "raise TypeError('TiledMLP expects a tensor')",
                 "m = 'run it untiled (tiled_mlp.core.untile(module))'", "x = self.gate_proj(x)", "is_tiled_loss_x = 1",
                 "m = 'a tiled loss, see tiled_loss.py'", "def f():\n    'a docstring naming deepspeed'\n    return 1"):
        assert not violations(fine, "core.py"), (fine, violations(fine, "core.py"))


def test_the_report_names_file_and_line():
    assert violations("x = 1\nimport transformers\n", "tiled_core/a.py") == [
        "tiled_core/a.py:2: imports transformers (names the library 'transformers')"]
    assert violations("from .a import b\n", "x.py") == []
