"""The documentation site builds with ``mkdocs build --strict``, and its API page renders the public names.

Strict (with the validation in ``mkdocs.yml``) turns every warning into a failure: a broken link or
anchor, a page left out of the nav, a cross-reference or a ``:::`` API name that does not resolve.
The negative controls build a copy of the configuration over one small page and show that each kind
of mistake fails the build, while the same page without it passes.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import autoaccum

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "mkdocs.yml"
#: a heading mkdocstrings renders for one object: its anchor and its kind (function, class, module ...)
HEADING = re.compile(r'<h\d id="(?P<id>[^"]+)"[^>]*>\s*<span class="doc doc-object-name doc-(?P<kind>\w+)-name">')


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner about MkDocs 2 says nothing about the site
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config), "--site-dir", str(site)],
        check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    run = _build(CONFIG, out)
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    return out


def _headings(page: Path) -> dict[str, str]:
    return {m["id"]: m["kind"] for m in HEADING.finditer(page.read_text())}


def test_every_page_is_built(site: Path) -> None:
    pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md"))
    assert {"index", "api", "fit", "guard", "memory", "distributed"} <= set(pages)
    for name in pages:
        assert (site / ("index.html" if name == "index" else f"{name}/index.html")).is_file(), name


def test_api_page_renders_the_functions(site: Path) -> None:
    """``autoaccum.fit``, ``probe`` and ``search`` are functions exported under the names of modules
    or packages of the package; the page renders the functions, whichever griffe finds at the name."""
    headings = _headings(site / "api" / "index.html")
    for name in ("fit", "probe", "search"):
        kinds = {headings.get(f"autoaccum.{name}"), headings.get(f"autoaccum.{name}.{name}")}
        assert "function" in kinds, f"autoaccum.{name} is not rendered as a function: {kinds}"


def test_api_page_renders_the_public_names(site: Path) -> None:
    headings = _headings(site / "api" / "index.html")
    classes = ["autoaccum.OOMGuard", "autoaccum.FitResult", "autoaccum.Plan", "autoaccum.ProbeReport",
               "autoaccum.TrackedMemory", "autoaccum.distributed.DistributedSync",
               "autoaccum.integrations.transformers.AutoAccumTrainer", "autoaccum.integrations.lightning.AutoAccum",
               "autoaccum.AutoAccumError", "autoaccum.DoesNotFitError", "autoaccum.OptimizerStepOOMError",
               "autoaccum.NonFiniteError", "autoaccum.TaskError"]
    functions = ["autoaccum.scale_lr", "autoaccum.emulated_budget", "autoaccum.distributed.init_from_env",
                 "autoaccum.integrations.accelerate.guard_for"]
    for name in classes:
        assert headings.get(name) == "class", name
    for name in functions:
        assert headings.get(name) == "function", name
    # every name `import autoaccum` exports is on the page (the distributed ones under autoaccum.distributed)
    missing = [name for name in autoaccum.__all__ if not {
        f"autoaccum.{name}", f"autoaccum.{name}.{name}", f"autoaccum.distributed.{name}"} & set(headings)]
    assert not missing, f"exported by autoaccum but not on docs/api.md: {missing}"
    assert "autoaccum.OOMGuard.accumulate" in headings  # members are rendered too


def test_fit_page_lists_every_option() -> None:
    """docs/fit.md's table names every keyword option ``fit`` takes (a new option is documented)."""
    table = (ROOT / "docs" / "fit.md").read_text()
    options = [f.metadata.get("option") or f.name for group in dataclasses.fields(autoaccum.FitConfig)
               for f in dataclasses.fields(group.default_factory())]  # type: ignore[misc]
    assert len(options) > 20
    missing = [name for name in options if f"`{name}`" not in table]
    assert not missing, f"fit options not in docs/fit.md: {missing}"


def _copy_config(tmp_path: Path, page: str) -> Path:
    """mkdocs.yml as it is, over a docs folder of one page holding ``page`` (and a second page to link to)."""
    config = yaml.safe_load(CONFIG.read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(page)
    (docs / "other.md").write_text("# Other\n\n## A section\n")
    config["docs_dir"] = str(docs)
    config["nav"] = [{"Home": "index.md"}, {"Other": "other.md"}]
    handler = config["plugins"][[next(iter(p)) if isinstance(p, dict) else p
                                 for p in config["plugins"]].index("mkdocstrings")]
    handler["mkdocstrings"]["handlers"]["python"]["paths"] = [str(ROOT)]
    path = tmp_path / "mkdocs.yml"
    path.write_text(yaml.safe_dump(config))
    return path


GOOD_PAGE = "# Home\n\nSee [other](other.md#a-section) and [the guard][autoaccum.OOMGuard].\n\n::: autoaccum.OOMGuard\n"


@pytest.mark.parametrize("page, says", [
    (GOOD_PAGE, None),  # the control: the copied configuration builds this page
    (GOOD_PAGE.replace("other.md#", "missing.md#"), "missing.md"),  # a broken link
    (GOOD_PAGE.replace("#a-section", "#no-such-section"), "no-such-section"),  # a broken anchor
    (GOOD_PAGE + "\n::: autoaccum.NoSuchName\n", "autoaccum.NoSuchName"),  # an API name that does not exist
    (GOOD_PAGE.replace("[autoaccum.OOMGuard]", "[autoaccum.NoSuchGuard]"), "autoaccum.NoSuchGuard"),  # a cross-ref
], ids=["control", "broken-link", "broken-anchor", "missing-api-name", "missing-cross-reference"])
def test_strict_build_fails_on_mistakes(tmp_path: Path, page: str, says: str | None) -> None:
    run = _build(_copy_config(tmp_path, page), tmp_path / "site")
    output = run.stdout + run.stderr
    if says is None:
        assert run.returncode == 0, output
    else:
        assert run.returncode != 0, f"the strict build passed a page with {says!r}:\n{output}"
        assert says in output, output
