"""The command line as a whole: commands, usage errors, help, exit statuses, pipes, imports."""
import importlib.util
import re
import subprocess
import sys

import pytest

import fastattn
from fastattn.cli import common
from fastattn.cli.main import main

from conftest import ROOT, run_cli


# ---------------------------------------------- commands, usage errors, help

@pytest.mark.parametrize("args, message", [
    (["bench", "--shapes", "tiny,nope"], "unknown shape(s) nope"),
    (["bench", "--repeat", "0"], "--repeat must be >= 1"),
    (["bench", "--threads", "0"], "--threads must be >= 1"),
    (["bench", "--repeat", "many"], "invalid int value"),
    (["frobnicate"], "invalid choice"),
])
def test_usage_errors_exit_2(args, message):
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_no_command_prints_help_and_exits_2():
    proc = run_cli()
    assert proc.returncode == 2
    assert "bench" in proc.stderr and "info" in proc.stderr and "demo" in proc.stderr


def test_help_lists_the_exit_statuses(capsys):
    for command in ([], ["bench"], ["info"], ["demo"]):
        assert main([*command, "--help"]) == 0
        out = capsys.readouterr().out
        assert "exit status:" in out
        for status in (common.OK, common.FAILED, common.USAGE, common.ENVIRONMENT):
            assert f"\n  {status}  " in out


def _help_statuses(command, capsys):
    assert main([command, "--help"]) == 0
    statuses = {}
    for line in capsys.readouterr().out.split("exit status:")[1].splitlines():
        m = re.match(r"  (\d)  (.*)", line)
        if m:
            status = int(m.group(1))
            statuses[status] = m.group(2)
        elif line.strip():
            statuses[status] += " " + line.strip()
    return statuses


def test_info_and_demo_help_list_only_what_they_can_return(capsys):
    # info and demo check nothing: their 1 is only a closed stdout; their 3 only their
    # own environment failure.
    info_statuses = _help_statuses("info", capsys)
    demo_statuses = _help_statuses("demo", capsys)
    for statuses in (info_statuses, demo_statuses):
        assert set(statuses) == {0, 1, 2, 3}
        assert "correctness" not in statuses[1] and "went away" in statuses[1]
    assert "matplotlib" not in info_statuses[3] and "installed one" in info_statuses[3]
    assert "matplotlib" in demo_statuses[3] and "imported" not in demo_statuses[3]
    assert "correctness" in _help_statuses("bench", capsys)[1]


def test_version_prints_the_version_and_exits_0():
    proc = run_cli("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(fastattn.__version__)


# ------------------------------------------------- failing early and quietly

@pytest.mark.parametrize("command", [["bench", "--shapes", "tiny"], ["demo"]])
def test_plot_without_matplotlib_fails_before_the_run(command, monkeypatch, tmp_path, capsys):
    # Nothing is measured or printed: the missing dependency is reported at once, with
    # how to install it, and the environment's exit status.
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # makes `import matplotlib` fail
    target = tmp_path / "plots"
    assert main([*command, "--plot", str(target)]) == common.ENVIRONMENT
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "--plot needs matplotlib" in captured.err and "pip install matplotlib" in captured.err
    assert not target.exists()


@pytest.mark.parametrize("command", [["info"], ["demo"], ["bench", "--shapes", "tiny"]])
def test_closed_pipe_ends_quietly(command):
    # `python -m fastattn info | head -3`: the reader goes away. Closing our end before the
    # child writes its first line makes the broken pipe certain rather than a race.
    proc = subprocess.Popen([sys.executable, "-m", "fastattn", *command], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    proc.wait(timeout=300)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert proc.returncode == 1


# -------------------------------------------------------------------- layout

def test_the_library_never_imports_the_command_line():
    # Run in a fresh interpreter: every library module imported, no fastattn.cli module.
    code = ("import sys, fastattn, fastattn.reference, fastattn.layers, fastattn.positions, "
            "fastattn.integrations.transformers, fastattn.integrations.tabpfn; "
            "print([m for m in sys.modules if m.startswith(('fastattn.cli', 'fastattn.__main__'))])")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def _cli_imports():
    """{module: fastattn.cli modules it imports anywhere in its code}, from the source."""
    import ast
    import pkgutil
    import fastattn.cli as cli

    graph = {}
    for mod in pkgutil.walk_packages(cli.__path__, "fastattn.cli."):
        spec = importlib.util.find_spec(mod.name)
        is_pkg = spec.submodule_search_locations is not None
        package = mod.name if is_pkg else mod.name.rsplit(".", 1)[0]
        tree = ast.parse(open(spec.origin).read())
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = (importlib.util.resolve_name("." * node.level + (node.module or ""),
                                                    package) if node.level else node.module)
                # `from . import harness` imports a module; `from .x import f` imports x.
                targets |= {f"{base}.{a.name}" if _is_module(f"{base}.{a.name}") else base
                            for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[mod.name] = {t for t in targets if t.startswith("fastattn.cli.") and t != mod.name}
    return graph


def _is_module(name):
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, AttributeError, ValueError):
        return False


def test_no_import_cycles_in_the_command_line():
    graph = _cli_imports()
    assert "fastattn.cli.bench.harness" in graph["fastattn.cli.bench.measure"]
    state = {}

    def visit(node, path):
        if state.get(node) == "done":
            return
        assert state.get(node) != "open", f"import cycle: {' -> '.join(path + [node])}"
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])
        state[node] = "done"

    for node in sorted(graph):
        visit(node, [])
