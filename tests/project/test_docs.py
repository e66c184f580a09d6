"""The docs site's pages (docs/**/*.md and README.md) stay true to the code.

What a reader copies must work: every schedule snippet validates, every Python snippet parses and
imports only names retune has, every file, ``make`` target and ``python -m`` module a page names
exists, the CLI output a page quotes is what the CLI prints, and the generated schedule reference
lists every field of the pydantic models. None of this needs mkdocs, so it runs in both stacks; the
strict site build itself (broken links, unknown anchors, unresolved docstring references) runs where
mkdocs is installed (the main stack, and ``make docs`` in CI) and skips elsewhere.
The benchmark numbers the pages quote are held by tests/project/test_benchmark_tables.py.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
import types
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from retune import RetuneSchedule, load_schedule
from retune.cli import main as cli_main
from retune.schedule.models import TRIGGER_KINDS

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', re.M)
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _expand(text: str) -> str:
    """Inline pymdownx.snippets includes (``--8<-- "path"``), as the site build does."""
    return SNIPPET.sub(lambda m: (ROOT / m.group(1)).read_text(encoding="utf-8").rstrip("\n"), text)


def _blocks(language: str) -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for lang, body in FENCE.findall(page.read_text(encoding="utf-8")):
            if lang == language:
                found.append((_page_id(page), _expand(body)))
    return found


def _load_hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("retune_docs_generated", DOCS / "hooks" / "generated.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- snippets


def test_every_schedule_snippet_validates(monkeypatch: pytest.MonkeyPatch) -> None:
    """A YAML block whose keys are schedule keys is a schedule, or a part of one: it must load.

    A part without ``triggers`` (``search: {objective: throughput}``) is completed with a
    ``fit_start`` trigger, the one key every schedule needs; anything else in it must be valid as
    written. Other YAML (a LightningCLI config) must parse, and every schedule file it names exist.
    Validation imports the dotted paths a schedule names; the pages' example user package
    (``mypkg.sizes.tokens``, ``mypkg.items.count``) is provided as the user's project would.
    """
    _example_user_package(monkeypatch)
    schedule_keys = set(RetuneSchedule.model_fields)
    checked = 0
    for page, body in _blocks("yaml"):
        data = yaml.safe_load(body)
        assert isinstance(data, dict), f"{page}: a YAML block that is not a mapping:\n{body}"
        if set(data) <= schedule_keys:
            data.setdefault("triggers", [{"kind": "fit_start"}])
            load_schedule(data)  # raises ScheduleError naming the field
            checked += 1
        else:
            for path in re.findall(r"schedule: (\S+\.(?:yaml|json|toml))", body):
                assert (ROOT / path).is_file(), f"{page}: names a schedule that does not exist: {path}"
    assert checked >= 6, "the pages lost their schedule snippets"


def _example_user_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """``mypkg`` with ``sizes.tokens`` and ``items.count``: the user functions the pages' schedules name."""
    package = types.ModuleType("mypkg")
    package.__path__ = []
    for name, attr in (("sizes", "tokens"), ("items", "count")):
        module = types.ModuleType(f"mypkg.{name}")
        setattr(module, attr, lambda value: 1)
        setattr(package, name, module)
        monkeypatch.setitem(sys.modules, f"mypkg.{name}", module)
    monkeypatch.setitem(sys.modules, "mypkg", package)


def test_every_python_snippet_parses_and_imports_what_exists() -> None:
    """Python blocks are parsed, and every ``from retune... import name`` must name something real.

    Names are checked against the module's source (its ``__all__``, else its top-level names), not by
    importing it: ``retune.integrations.flash`` needs lightning-flash, which only one stack has.
    """
    blocks = _blocks("python")
    assert len(blocks) >= 6, "the pages lost their Python snippets"
    for page, body in blocks:
        tree = ast.parse(body, filename=page)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "retune":
                provided = _module_names(node.module)
                for alias in node.names:
                    assert alias.name in provided, f"{page}: `from {node.module} import {alias.name}`: no such name"


def _module_names(module: str) -> set[str]:
    base = ROOT.joinpath(*module.split("."))
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    assert path.is_file(), f"no module {module}"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


_REPO_PATH = re.compile(r"(?<![\w/.-])((?:schedules|examples|tests|retune|requirements|docs|\.ci)/[\w./*-]*[\w*/])")


def test_every_repository_path_a_page_names_exists() -> None:
    """Paths such as ``examples/fsdp2_finetune.py``, ``tests/integrations/test_hf.py::test_x``, ``x.json``."""
    missing = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for path in set(_REPO_PATH.findall(text)):
            if not (path.endswith("/") or "." in path.rsplit("/", 1)[-1]):
                continue  # a logged metric key (`retune/batch_size`), not a file
            if "*" in path:
                if not list(ROOT.glob(path)):
                    missing.append(f"{_page_id(page)}: {path}")
            elif not (ROOT / path).exists():
                missing.append(f"{_page_id(page)}: {path}")
    assert not missing, "pages name files that do not exist:\n" + "\n".join(sorted(missing))


def test_every_make_target_and_module_a_page_runs_exists() -> None:
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M))
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"`make ([\w-]+)", text) + re.findall(r"^make ([\w-]+)", text, re.M):
            assert target in targets, f"{_page_id(page)}: `make {target}`: no such target in the Makefile"
        for module in re.findall(r"python -m ([\w.]+)", text):
            base = ROOT.joinpath(*module.split("."))
            exists = base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()
            assert exists or module == "pytest", f"{_page_id(page)}: `python -m {module}`: no such module"


def test_quoted_validate_error_is_what_the_cli_prints(tmp_path: Path) -> None:
    """The schedule reference quotes `retune validate` on a misspelt key: the text must be current."""
    text = (DOCS / "reference" / "schedule.md").read_text(encoding="utf-8")
    match = re.search(r"\$ retune validate broken\.yaml[^\n]*\n(error: [^\n]+)", text)
    assert match, "the schedule reference lost its `retune validate` example"
    schedule = tmp_path / "broken.yaml"
    schedule.write_text("search:\n  steps_per_trail: 3\ntriggers:\n  - kind: fit_start\n", encoding="utf-8")
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        assert cli_main(["validate", str(schedule)]) == 1
    assert stderr.getvalue().strip().replace(str(schedule), "broken.yaml") == match.group(1)


# ---------------------------------------------------------------- generated references


def _field_paths(model: type[BaseModel], prefix: str = "") -> set[str]:
    paths = set()
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        paths.add(path)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            paths |= _field_paths(annotation, f"{path}.")
    return paths


def test_schedule_reference_lists_every_field_of_the_models() -> None:
    """Generated from the models, so a field added to the code appears with its type and default."""
    reference = _load_hooks().schedule_reference_markdown()
    rows = set(re.findall(r"^\| `([\w.]+)` \|", reference, re.M))
    nested = {p for p in _field_paths(RetuneSchedule) if isinstance(_field_at(p), type)}
    assert _field_paths(RetuneSchedule) - nested <= rows
    for section in nested:
        assert f"### `{section}`" in reference, f"no section for {section}"
    sections = re.split(r"^#### ", reference, flags=re.M)[1:]
    kinds = [re.match(r"`kind: (\w+)`", s).group(1) for s in sections]  # type: ignore[union-attr]
    assert kinds == list(TRIGGER_KINDS)
    for kind, section in zip(kinds, sections, strict=True):
        model = load_schedule({"triggers": [_minimal_trigger(kind)]}).triggers[0]
        for field in type(model).model_fields:
            if field != "kind":
                assert f"| `{field}` |" in section, f"trigger {kind}: field {field} missing from the reference"


def _field_at(path: str) -> Any:
    model: Any = RetuneSchedule
    for part in path.split("."):
        annotation = model.model_fields[part].annotation
        model = annotation
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _minimal_trigger(kind: str) -> dict[str, Any]:
    return {"kind": kind, "at": [1]} if kind == "epoch" else {"kind": kind}


def test_schedule_reference_shows_types_defaults_and_constraints() -> None:
    reference = _load_hooks().schedule_reference_markdown()
    assert "| `search.init_val` | int | `2` | >= 1 |" in reference
    assert "| `search.margin` | float | `0.05` | >= 0.0, < 1.0 |" in reference
    assert "| `search.mode` | power \\| binsearch \\| model | `binsearch` |" in reference
    assert "| `triggers` | list of triggers" in reference and "| required |" in reference


def test_committed_generated_sections_are_current() -> None:
    """The pages hold the generated references between their markers, as the code generates them now.

    Read on GitHub or in an editor (no site build), a page shows what is committed: a field added to a model,
    or an option to the CLI, without ``make docs-generate`` would leave the page behind the code.
    """
    hooks = _load_hooks()
    stale = [str(page.relative_to(ROOT)) for page in hooks.stale_pages()]
    assert not stale, f"stale generated sections in {stale}: run `make docs-generate`"


def test_stale_generated_section_is_found_and_rewritten(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A page whose generated section lags the code is reported (exit 1, naming the page) and ``--write`` mends it."""
    hooks = _load_hooks()
    page = tmp_path / "cli.md"
    current = hooks.PAGES[hooks.CLI_SECTION].read_text(encoding="utf-8")
    page.write_text(current.replace("usage: retune validate", "usage: retune validat"), encoding="utf-8")
    monkeypatch.setattr(hooks, "PAGES", {hooks.CLI_SECTION: page})
    monkeypatch.setattr(hooks, "ROOT", tmp_path)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        assert hooks.main(["--check"]) == 1
    assert "cli.md: generated section is stale; run `make docs-generate`" in stderr.getvalue()
    assert hooks.main(["--write"]) == 0
    assert page.read_text(encoding="utf-8") == current
    assert hooks.main(["--check"]) == 0
    page.write_text("# no markers\n", encoding="utf-8")
    with contextlib.redirect_stderr(io.StringIO()):
        assert hooks.main(["--check"]) == 1
        assert hooks.main(["--write"]) == 1


def test_cli_reference_has_every_subcommand() -> None:
    reference = _load_hooks().cli_reference_markdown()
    for command in ("validate", "schema", "show", "demo", "report"):
        assert f"### `retune {command}`" in reference
        assert f"usage: retune {command}" in reference


def test_logged_metrics_table_names_every_key_the_reports_log() -> None:
    """The API page's table of logged keys is the set of keys ``retune/reports`` builds."""
    source = "".join((ROOT / "retune" / "reports" / f).read_text(encoding="utf-8") for f in ("batch_size.py", "lr.py"))
    logged = set(re.findall(r"\{prefix\}([a-z_]+)", source)) | set(re.findall(r"\"retune/([a-z_]+)", source))
    page = (DOCS / "reference" / "api" / "callbacks.md").read_text(encoding="utf-8")
    documented = set(re.findall(r"^\| `retune/([a-z_]+)(?:<i>)?` \|", page, re.M))
    assert documented == logged


def test_nav_lists_every_page() -> None:
    """A page left out of mkdocs.yml's nav is unreachable; a nav entry without a page breaks the build."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))

    def pages(nav: Any) -> list[str]:
        if isinstance(nav, str):
            return [nav]
        if isinstance(nav, dict):
            return [p for value in nav.values() for p in pages(value)]
        return [p for item in nav for p in pages(item)]

    listed = pages(config["nav"])
    on_disk = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(listed) == on_disk


# ---------------------------------------------------------------- the site build


def test_site_builds_strict(tmp_path: Path) -> None:
    """``mkdocs build --strict``: a broken link or anchor, a missing page or an unresolved reference fails."""
    pytest.importorskip("mkdocs", reason="the docs extra (mkdocs) is installed in the main stack only")
    pytest.importorskip("mkdocstrings")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    page = (tmp_path / "site" / "reference" / "schedule" / "index.html").read_text(encoding="utf-8")
    assert "search.throughput_tolerance" in page  # the generated tables made it into the page
