"""What a newcomer meets when something is off: refusals that name the argument, YAML errors
with their line, every option's help and default, --version, and epoch lines above the bar."""

import argparse
import io
import sys

import pytest

from mlxwalk import cli
from mlxwalk.dropin import lora
from mlxwalk.errors import ConfigError
from mlxwalk.training import options, report
from mlxwalk.walk import window_gradient


def test_the_drop_in_refuses_alpha_without_scale_as_mlx_lm_does(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("model: m\ntrain: true\nlora_parameters: {rank: 4, alpha: 16}\n")
    assert lora.main(["-c", str(config)]) == 2
    err = capsys.readouterr().err
    assert err == (
        "mlxwalk.lora: error: lora_parameters has 'alpha' but no 'scale': mlx-lm's LoRA config "
        "uses 'scale', not 'alpha' (unlike some other LoRA frameworks)\n"
    )


def test_the_drop_in_says_an_uninstalled_logger_once(monkeypatch, tmp_path):
    from mlx_lm.tuner import callbacks

    monkeypatch.setattr(callbacks, "wandb", None)
    o = argparse.Namespace(report_to="wandb", project_name=None, adapter_path=str(tmp_path))
    with pytest.raises(ConfigError) as e:
        lora.reporting(o)
    assert str(e.value) == "--report-to wandb: wandb is not installed (pip install wandb)"


def test_the_api_names_the_argument_at_fault(qwen2, qwen2_path):
    import mlx_lm

    frozen, _ = mlx_lm.load(qwen2_path)
    frozen.freeze()
    window = ([1, 2, 3], [2, 3, 4], [1, 1, 1])
    with pytest.raises(ValueError, match="^model has no trainable parameters"):
        window_gradient(frozen, *window, chunk=2)
    with pytest.raises(ValueError, match="^chunk must be an integer, got 8.0$"):
        window_gradient(qwen2, *window, chunk=8.0)
    with pytest.raises(ValueError, match="^memory_budget_mib must be a positive, finite number"):
        window_gradient(qwen2, *window, chunk=2, memory_budget_mib=float("nan"))
    with pytest.raises(ValueError, match="^horizon must be an integer"):
        window_gradient(qwen2, *window, chunk=2, horizon=1.5)


def test_a_yaml_syntax_error_names_its_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: x\niters: 3\n  chunk: [1, 2\n")
    said = f"{bad}, line 3, column 8: not valid YAML (mapping values are not allowed here)\n"
    assert cli.main(["train", "-c", str(bad)]) == 2
    assert capsys.readouterr().err == f"mlxwalk: error: {said}"
    assert lora.main(["-c", str(bad)]) == 2
    assert capsys.readouterr().err == f"mlxwalk.lora: error: {said}"


class Terminal:
    """The standard output and error of one terminal: two streams, one screen."""

    def __init__(self):
        self.text = io.StringIO()
        self.out, self.err = self.Stream(self.text), self.Stream(self.text)

    class Stream(io.TextIOBase):
        def __init__(self, text):
            self.text = text

        def write(self, s):
            return self.text.write(s)

        def isatty(self):
            return True

    def screen(self) -> list[str]:
        """The lines the terminal shows: a carriage return writes over its line."""
        lines, row, col = [[]], 0, 0
        text = self.text.getvalue().replace("\x1b[A", "\x00")
        for c in text:
            if c == "\x00":
                row = max(row - 1, 0)
            elif c == "\r":
                col = 0
            elif c == "\n":
                row, col = row + 1, 0
                lines += [[]] * (row == len(lines))
            else:
                line = lines[row] = lines[row] + [" "] * (col + 1 - len(lines[row]))
                line[col], col = c, col + 1
        return [s for s in ("".join(line).rstrip() for line in lines) if s]


def test_epoch_lines_land_above_the_bar_on_a_terminal(monkeypatch):
    tty = Terminal()
    monkeypatch.setattr(sys, "stdout", tty.out)
    monkeypatch.setattr(sys, "stderr", tty.err)
    bar = report.progress(3)
    bar.chunk("decode", 1, 2)
    bar.window(2.5, 100.0, 10.0)
    print("epoch 1: train_loss 2.5000", flush=True)
    bar.window(2.4, 100.0, 10.0)
    bar.window(2.3, 100.0, 10.0)
    print("epoch 2: train_loss 2.3500", flush=True)
    bar.close()  # (the run closes it once more)
    print("| epoch | train_loss |")
    assert sys.stdout is tty.out  # the terminal's own stream again
    screen = tty.screen()
    assert [s for s in screen if "window" not in s] == [
        "epoch 1: train_loss 2.5000",
        "epoch 2: train_loss 2.3500",
        "| epoch | train_loss |",
    ]
    bars = [i for i, s in enumerate(screen) if "window" in s]
    assert len(bars) == 1 and "3/3" in screen[bars[0]] and bars[0] == 1, screen


def test_version(capsys):
    for main in (cli.main, lora.main):
        with pytest.raises(SystemExit) as e:
            main(["--version"])
        assert e.value.code == 0 and capsys.readouterr().out == "mlxwalk 0.1.0\n"


@pytest.mark.parametrize("plan", [False, True])
def test_every_option_with_a_default_shows_it(plan):
    p = argparse.ArgumentParser()
    options.add_flags(p, plan=plan)
    defaults = options.TrainConfig()
    shown = {a.dest: a.help for a in p._actions}
    for name in options.flags(plan):
        if getattr(defaults, name) is not None:
            assert "(default" in shown[name], (name, shown[name])
    assert "(default 0)" in shown["horizon"]
    if not plan:
        assert "(default 0.0)" in shown["dropout"] and "(default off)" in shown["overwrite"]


def test_every_drop_in_option_has_help_mlx_lms_own_where_it_is_mlx_lms():
    from mlx_lm.lora import build_parser

    theirs = {a.dest: a.help for a in build_parser()._actions}
    ours = lora.parser()._actions
    assert len(ours) > 35 and all(a.help for a in ours), [a.dest for a in ours if not a.help]
    helps = {a.dest: a.help for a in ours}
    assert helps["iters"] == theirs["iters"] and helps["config"] == theirs["config"]
    assert helps["chunk"] == "positions per chunk (default 512)"
    assert "nothing is downloaded" in helps["data"]


def test_an_unknown_train_flag_shows_trains_usage(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--bogus"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: mlxwalk train [-h]")
    assert err.endswith("mlxwalk train: error: unrecognized arguments: --bogus\n")
