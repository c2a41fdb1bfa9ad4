"""test_docs.py: the repository keeps the shape its README promises a reader: the README a map of at
most 250 lines whose reading order (with true line counts) is on its first screen, docs/ pages under
300 lines, every code file under 400 lines (tests 500) with functions under 60, each opening with a
docstring that names it, no import cycle, and nothing pointing at a document outside the repository.
"""
import ast
import re

from conftest import ROOT

CORE = ("model.py", "layouts.py", "sharding.py", "parallel.py", "pipeline.py", "kernels.py", "kernel_ops.py",
        "triton_kernels.py",
        "checkpointing.py", "lax.py", "dp_shard.py", "muon.py", "train.py")
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
    for name in CORE:
        row = next((line for line in readme if line.startswith(f"| [`{name}`]")), None)
        assert row, f"{name} is not in the reading order"
        assert int(row.split("|")[2]) == lines(ROOT / name), f"README says {row.split('|')[2]} lines for {name}"
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
    """The project modules a file imports, at its top or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
            if node.module == "plumbing":   # the package's modules by their names, as the root's
                names |= {a.name for a in node.names}
            elif node.module.startswith("plumbing."):
                names.add(node.module.split(".")[1])
    return names


STORY = [name for name in CORE if name != "train.py"]
COMMANDS = ("train.py", "prepare.py", "interchange.py")


def test_the_root_holds_the_story_and_the_commands_and_the_story_no_plumbing():
    """At the root only the story and the commands (at most 15 files); what a run needs around them
    is the plumbing package, which no story file imports (nor a command), and which imports no
    command; model.py, the reference, imports only torch, the standard library and lax.py; of the
    story, only sharding.py and muon.py import dp_shard.py."""
    root = sorted(p.name for p in ROOT.glob("*.py"))
    assert root == sorted([*STORY, *COMMANDS]) and len(root) <= 15, root
    assert (ROOT / "plumbing" / "__init__.py").exists()
    for name in STORY:
        assert not imports(ROOT / name) & {"plumbing", *(c[:-3] for c in COMMANDS)}, name
    import sys
    outside = imports(ROOT / "model.py") - set(sys.stdlib_module_names) - {"torch", "lax"}
    assert not outside, outside
    for name in STORY:   # FSDP stands beside the story: only these two meet its DTensors
        assert "dp_shard" not in imports(ROOT / name) or name in ("sharding.py", "muon.py"), name
    for path in sorted((ROOT / "plumbing").glob("*.py")):   # the arrows run from commands down
        assert not imports(path) & {c[:-3] for c in COMMANDS}, f"plumbing/{path.name} imports a command"


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
