"""test_docs.py: the repository keeps the shape its README promises a reader: the README a map of at
most 250 lines whose reading order (with true line counts) is on its first screen, the story at
the root importing no folder, no root name shadowing a package, docs/ pages under
300 lines, every code file under 400 lines (tests 500) with functions under 60, each opening with a
docstring that names it, no import cycle, and nothing pointing at a document outside the repository.
"""
import ast
import os
import re
from pathlib import Path

from conftest import ROOT

# BOOST's story, in the README's reading order, and the commands a user types
STORY = ("model.py", "lax.py", "layouts.py", "tp_model.py", "sharding.py", "parallel.py", "local_ops.py",
         "triton_kernels.py", "recompute.py")
COMMANDS = ("train.py", "prepare.py", "interchange.py")
EXTENSIONS = tuple(sorted(p.name for p in (ROOT / "extensions").glob("*.py") if p.name != "__init__.py"))
SKIP = {".venv", ".git", "data", "__pycache__", ".pytest_cache", "bench-results"}


def code_files():
    return sorted(p for p in ROOT.rglob("*.py") if not SKIP & set(p.relative_to(ROOT).parts)
                  and not p.relative_to(ROOT).parts[0].startswith("out"))


def lines(path):
    return len(path.read_text().splitlines())


def test_readme_is_a_map_with_the_reading_order_first():
    readme = (ROOT / "README.md").read_text().splitlines()
    assert len(readme) <= 250, len(readme)
    start = next(i for i, line in enumerate(readme) if line.startswith("## Read the code in this order"))
    assert start < 40, start   # on the first screen
    for name in (*STORY, "train.py", *(f"extensions/{e}" for e in EXTENSIONS)):
        row = next((line for line in readme if line.startswith(f"| [`{name}`]")), None)
        assert row, f"{name} is not in the reading order"
        assert int(row.split("|")[2]) == lines(ROOT / name), f"README says {row.split('|')[2]} lines for {name}"
    story_rows = [i for i, line in enumerate(readme) for name in STORY if line.startswith(f"| [`{name}`]")]
    assert story_rows == sorted(story_rows), "the story's table is not in the reading order"
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in "\n".join(readme), f"README does not link docs/{page.name}"
        assert lines(page) <= 300, (page.name, lines(page))


def test_code_files_and_functions_stay_small():
    for path in code_files():
        is_test = path.parent.name == "tests"
        assert lines(path) <= (500 if is_test else 400), (path.name, lines(path))
        if is_test:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno - node.lineno < 60, f"{path.name}: {node.name} is {node.end_lineno - node.lineno + 1} lines"


def test_code_lines_stay_within_100_characters():
    """Code outside tests/ at most 100 characters a line (characters, not bytes: σ is one)."""
    long = [f"{path.relative_to(ROOT)}:{i}" for path in code_files() if path.parent.name != "tests"
            for i, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 100]
    assert not long, long


def test_every_file_opens_with_a_docstring_naming_it():
    for path in code_files():
        doc = ast.get_docstring(ast.parse(path.read_text()))
        name = f"{path.parent.name}/{path.name}" if path.name == "__init__.py" else path.name
        assert doc and doc.startswith(f"{name}:"), path


def imports(path):
    """The project modules a file imports, at its top or inside functions (a package's modules by
    their names, as the root's)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
            names |= {a.name.split(".")[1] for a in node.names if a.name.startswith(PACKAGES)}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
            if node.module in PACKAGES:
                names |= {a.name for a in node.names}
            elif node.module.startswith(tuple(p + "." for p in PACKAGES)):
                names.add(node.module.split(".")[1])
    return names


PACKAGES = ("plumbing", "extensions")


def test_the_root_holds_the_story_and_the_commands_and_the_story_imports_no_folder():
    """At the root only BOOST's story and the three commands (at most 12 files, the story at most
    2,400 lines); what the project adds beyond the paper is extensions/ and what a run needs
    around them plumbing/, neither imported by a story file; model.py, the reference, imports only
    torch, the standard library and lax.py, and lax.py nothing of the project."""
    root = sorted(p.name for p in ROOT.glob("*.py"))
    assert root == sorted([*STORY, *COMMANDS]) and len(root) <= 12, root
    assert sum(lines(ROOT / name) for name in STORY) <= 2400
    folders = {*PACKAGES, "tools", "tests", *(c[:-3] for c in COMMANDS)}
    folders |= {p.stem for d in PACKAGES for p in (ROOT / d).glob("*.py")}
    for name in STORY:
        assert not imports(ROOT / name) & folders, (name, imports(ROOT / name) & folders)
    import sys
    outside = imports(ROOT / "model.py") - set(sys.stdlib_module_names) - {"torch", "lax"}
    assert not outside, outside
    assert not imports(ROOT / "lax.py") - set(sys.stdlib_module_names) - {"torch"}
    for path in sorted((ROOT / "plumbing").glob("*.py")):   # the arrows run from commands down
        assert not imports(path) & {c[:-3] for c in COMMANDS}, f"plumbing/{path.name} imports a command"


def test_importing_the_reference_loads_no_collective_layout_or_triton():
    """`import model` in a fresh interpreter: of the project only model and lax, and nothing of
    Triton (TRITON_INTERPRET unset: the kernels' side sets it when imported)."""
    import subprocess
    import sys
    code = ("import os, sys; import model; print(sorted(m for m in sys.modules if m in {names})); "
            "print([m for m in sys.modules if m.split('.')[0] == 'triton']); "
            "print(os.environ.get('TRITON_INTERPRET'))")
    project = sorted(p.stem for p in ROOT.glob("*.py")) + list(PACKAGES)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code.format(names=project)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout.splitlines()
    assert out == ["['lax', 'model']", "[]", "None"], out


def test_a_layouts_name_is_written_in_at_most_three_code_files():
    """Every layout is one record in layouts.py that the rest reads: its name, a string literal,
    stands in at most three code files outside tests/ and tools/."""
    import layouts
    for name in layouts.LAYOUTS:
        holders = [str(p.relative_to(ROOT)) for p in code_files()
                   if p.relative_to(ROOT).parts[0] not in ("tests", "tools")
                   and any(isinstance(n, ast.Constant) and n.value == name
                           for n in ast.walk(ast.parse(p.read_text())))]
        assert "layouts.py" in holders and len(holders) <= 3, (name, holders)


def test_no_root_name_shadows_a_package_the_ecosystem_imports():
    """A module at the root (or a folder) named like a package that transformers, lm-eval,
    accelerate or torch import (kernels, say) is what `import kernels` finds when they run from
    the project's folder: the names they import, read from their sources, and the ones their
    optional integrations try, meet none of ours."""
    import importlib.util
    ours = {p.stem for p in ROOT.glob("*.py")} | {p.name for p in ROOT.iterdir() if p.is_dir()
                                                   and (p / "__init__.py").exists()}
    imported = {"kernels", "flash_attn", "liger_kernel", "deepspeed", "apex", "bitsandbytes"}
    for package in ("transformers", "lm_eval", "accelerate", "torch"):
        spec = importlib.util.find_spec(package)
        for path in Path(spec.origin).parent.rglob("*.py"):
            text = path.read_text(errors="replace")
            imported |= set(re.findall(r"^\s*(?:import|from)\s+([A-Za-z_]\w*)", text, re.M))
            imported |= set(re.findall(r"""(?:is_package_available|find_spec|import_module)\(\s*["']([A-Za-z_]\w*)""", text))
    assert not ours & imported, ours & imported


def test_no_import_cycles():
    modules = {p.stem: p for p in code_files() if p.parent.name != "tests"}
    graph = {m: imports(p) & set(modules) - {m} for m, p in modules.items()}

    def visit(m, path):
        assert m not in path, "import cycle: " + " -> ".join(path[path.index(m):] + [m])
        for n in graph[m]:
            visit(n, path + [m])
    for m in graph:
        visit(m, [])


def test_nothing_points_outside_the_repository():
    texts = [p for p in ROOT.rglob("*") if p.is_file() and p.suffix in (".py", ".md", ".toml", ".ini", ".txt", ".cff")
             and not SKIP & set(p.relative_to(ROOT).parts) and not p.relative_to(ROOT).parts[0].startswith("out")]
    texts.append(ROOT / "Makefile")
    for path in texts:
        text = path.read_text()
        assert not re.search("boost" + r"-notes|\.\./" + "shared", text), f"{path.relative_to(ROOT)} points outside the repository"


def test_walkthrough_links_name_the_lines_that_hold_them():
    """docs/walkthrough.md's links, [file.py:N](../file.py#LN) followed by a name in backticks: line N
    of the file defines the named function or class (inside the named class where one is named)."""
    text = (ROOT / "docs" / "walkthrough.md").read_text()
    links = re.findall(r"\[([\w/]+\.py):(\d+)\]\(\.\./\1#L\2\)\s+`([\w.]+)`", text)
    assert len(links) >= 30, len(links)   # every question answered with its lines
    wrong = []
    for path, n, name in links:
        source = (ROOT / path).read_text().splitlines()
        *owner, last = name.split(".")
        line = source[int(n) - 1] if int(n) <= len(source) else ""
        classes = [s for s in source[:int(n) - 1] if re.match(r"class \w+", s)]
        inside = not owner or (classes and re.match(rf"class {owner[0]}\b", classes[-1]))
        if not (re.match(rf"\s*(def|class) {last}\b", line) and inside):
            held = [i for i, s in enumerate(source, 1) if re.match(rf"\s*(def|class) {last}\b", s)]
            wrong.append(f"{path}:{n} does not hold {name} (defined at {held})")
    assert not wrong, wrong
    assert not re.findall(r"\[[\w/]+\.py:\d+\]\((?!\.\./)", text)   # every link relative to docs/
