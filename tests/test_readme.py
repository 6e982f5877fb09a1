"""The README tells the truth about the repository: the package layout (docs/layout.md, linked from
its Package layout section) names every module,
``.ci/run`` runs exactly its install and test commands, and its links (and the docs') resolve."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def section(title: str) -> str:
    """The README's ``## title`` section, up to the next ``## `` heading."""
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:] if end < 0 else README[start:end]


def fenced_commands(title: str) -> list[str]:
    """The commands in the ``bash`` blocks of section `title`, comments stripped."""
    blocks = re.findall(r"```bash\n(.*?)```", section(title), re.S)
    return [line.split("#")[0].strip() for block in blocks for line in block.splitlines() if line.split("#")[0].strip()]


def test_package_layout_names_every_module():
    assert "(docs/layout.md)" in section("Package layout")
    layout = (ROOT / "docs" / "layout.md").read_text()
    package = ROOT / "lp_decentral_nlp"
    missing = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if path.name == "__init__.py" and path.parent != package:
            continue  # a subpackage's namespace; its modules are listed
        folder = relative.split("/")[0] + "/"
        if f"`{relative}`" not in layout and f"| `{folder}` |" not in layout:
            missing.append(relative)
    assert not missing, f"README's package layout does not name {missing}"


def test_ci_runs_the_readme_install_and_test_commands():
    ci = {line.strip().replace(" -q", "") for line in (ROOT / ".ci" / "run").read_text().splitlines()}  # quiet pip
    install, test = fenced_commands("Install"), fenced_commands("Run the tests")
    assert install and test, "the README's Install and Run the tests sections hold bash blocks"
    assert set(install + test) <= ci, f"not in .ci/run: {set(install + test) - ci}"


def test_relative_links_resolve():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not re.match(r"[a-z]+://", target) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, f"links to missing files: {broken}"


def test_every_name_the_docs_import_from_the_package_is_exported():
    """``from lp_decentral_nlp... import (...)`` in the README's and the docs' code imports: the README
    used ``DEFAULT_SKIP`` beside ``QuantConfig``, which the package root did not export."""
    import importlib

    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for code in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            for module, grouped, line in re.findall(r"^from (lp_decentral_nlp[\w.]*) import (?:\(([^)]*)\)|(.*))$", code, re.M):
                for name in re.findall(r"\w+", re.sub(r"#.*", "", grouped or line)):
                    if not hasattr(importlib.import_module(module), name):
                        missing.append(f"{page.name}: {module}.{name}")
    assert not missing, f"imported by the docs but not exported: {missing}"
