"""tools/run_deepep_tests.sh, on a stand-in DeepEP checkout (no GPU, no DeepEP files needed): the tree
it assembles imports this deep_ep with DeepEP's utils modules beside it and the `_C` stand-in, runs
the test with ``--num-processes 1`` and the extra arguments, logs to $OUT, and leaves nothing behind
in the repository or the temporary directory."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "run_deepep_tests.sh"

STAND_IN_TEST = '''
import os, sys
import deep_ep
import deep_ep.utils.envs as envs
from deep_ep.utils.event import EventOverlap
print("package", os.path.dirname(deep_ep.__file__))
print("event", EventOverlap is deep_ep.EventOverlap)
print("arguments", sys.argv[1:])
print("value", envs.VALUE)
try:
    envs._C.get_logical_domain_size
except AttributeError as exc:
    print("extension", exc)
print(" > Testing with mode=0 ...")
print(" > Testing with mode=1 ...")
'''


def _stand_in_checkout(path: Path) -> Path:
    utils = path / "deep_ep" / "utils"
    utils.mkdir(parents=True)
    (path / "tests" / "elastic").mkdir(parents=True)
    (path / "tests" / "elastic" / "test_ep.py").write_text(STAND_IN_TEST)
    # DeepEP's own __init__ imports its extension's EventHandle: the tree must not use it.
    (utils / "__init__.py").write_text("raise ImportError('the utils __init__ of the checkout was imported')\n")
    (utils / "envs.py").write_text("import deep_ep._C as _C\nfrom .math import VALUE\n")
    (utils / "math.py").write_text("VALUE = 41 + 1\n")
    # DeepEP's event.py wraps its extension's events: this package's own deep_ep.utils.event stays.
    (utils / "event.py").write_text("raise ImportError('the event module of the checkout was imported')\n")
    for name in ("gate", "refs", "testing"):
        (utils / f"{name}.py").write_text("from . import envs  # noqa: F401\n")
    return path


def _run(tmp_path: Path, checkout: Path, *args: str, **env) -> subprocess.CompletedProcess:
    environment = dict(os.environ, DEEPEP_DIR=str(checkout), OUT=str(tmp_path / "out"),
                       TMPDIR=str(tmp_path / "tmp"), **env)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return subprocess.run(["bash", str(SCRIPT), *args], env=environment, capture_output=True, text=True,
                          timeout=300)


def test_runs_the_test_in_a_temporary_tree(tmp_path):
    checkout = _stand_in_checkout(tmp_path / "deepep")
    done = _run(tmp_path, checkout, "--skip-perf-test", "--num-tokens", "128")
    assert done.returncode == 0, done.stdout + done.stderr
    log = (tmp_path / "out" / "deepep_test_ep.log").read_text()
    lines = dict(line.split(" ", 1) for line in log.splitlines() if line.split(" ", 1)[0] in
                 ("package", "arguments", "value", "extension", "event"))
    package = Path(lines["package"])
    assert package.parent.parent == tmp_path / "tmp" and package.name == "deep_ep"
    assert lines["arguments"] == "['--num-processes', '1', '--skip-perf-test', '--num-tokens', '128']"
    assert lines["value"] == "42" and lines["event"] == "True"
    assert "deep_ep._C.get_logical_domain_size" in lines["extension"]
    assert "modes started: 2" in log and "modes started: 2" in done.stdout
    assert not any((tmp_path / "tmp").iterdir()), "the temporary tree was left behind"
    # nothing of DeepEP's lands in the repository: no stand-in extension, no utils modules beside ours
    assert not (ROOT / "deep_ep" / "_C.py").exists()
    assert sorted(p.name for p in (ROOT / "deep_ep" / "utils").glob("*.py")) == ["__init__.py", "event.py"]


def test_import_only_stops_before_the_test(tmp_path):
    checkout = _stand_in_checkout(tmp_path / "deepep")
    done = _run(tmp_path, checkout, DEEPEP_IMPORT_ONLY="1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "DeepEP's utils imported" in done.stdout and "modes started" not in done.stdout


def test_a_missing_checkout_is_named(tmp_path):
    done = _run(tmp_path, tmp_path / "nowhere")
    assert done.returncode == 2
    assert "git -C <DeepEP git dir> archive HEAD tests deep_ep/utils" in done.stderr


def test_the_checkout_folder_is_ignored():
    assert ".deepep/" in (ROOT / ".gitignore").read_text().splitlines()
