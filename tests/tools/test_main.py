"""tools.main, the umbrella ``ckpt`` command, and what every tool's main shares (tools.cli.command):
Ctrl-C is one ``interrupted`` line and exit 130, a closed pipe ends a tool quietly."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.support.chains import train_with_chain


def test_the_umbrella_dispatches_to_each_tool(tmp_path, capsys):
    from tools.main import COMMANDS, main

    assert set(COMMANDS) == {"inspect", "merge", "convert", "replay", "copy", "prune"}
    assert main(["--help"]) == 0
    listing = capsys.readouterr().out
    assert all(f"  {name} " in listing for name in COMMANDS)
    assert main([]) == 2 and "usage: ckpt COMMAND" in capsys.readouterr().err
    assert main(["--version"]) == 0 and capsys.readouterr().out.startswith("ckpt ")
    assert main(["frobnicate"]) == 2 and "unknown command 'frobnicate'" in capsys.readouterr().err
    train_with_chain(tmp_path / "run", steps=2)
    assert main(["prune", str(tmp_path / "run"), "--keep", "1", "--json"]) == 0
    assert '"deleted": [1]' in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "run")]) == 0 and "step" in capsys.readouterr().out


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    """A real SIGINT in the middle of a merge: no traceback, no output file."""
    train_with_chain(tmp_path / "run", steps=1)
    out = tmp_path / "model.safetensors"
    result = _run(f"""
        import os, signal, time
        import ckpt.convert, tools.merge
        # Python raises KeyboardInterrupt only where SIGINT was not ignored at its start; a job
        # started in the background (a CI runner, `cmd &`) inherits it ignored.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        def interrupted(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)
        tools.merge.merge = interrupted
        raise SystemExit(tools.merge.main([{str(tmp_path / "run")!r}, {str(out)!r}, "--quiet"]))
    """)
    assert result.returncode == 130, result.stderr
    assert result.stderr == "ckpt-merge: interrupted\n"
    assert not out.exists() and list(tmp_path.iterdir()) == [tmp_path / "run"]


def test_a_closed_pipe_ends_a_tool_quietly():
    """``ckpt-inspect ROOT | head -1``: the reader goes away, the tool exits 0 without a traceback."""
    reader = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        from tools.cli import command
        @command("ckpt-test")
        def main():
            for n in range(10**6):
                print("step", n)
            return 0
        raise SystemExit(main())
    """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert reader.stdout.readline() == b"step 0\n"
    reader.stdout.close()
    assert reader.wait(timeout=120) == 0
    assert reader.stderr.read() == b""
