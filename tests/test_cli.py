"""Bad command-line input: one line naming the option, exit 2, nothing started."""

import pytest
from typer.testing import CliRunner

from flows.cli import app

runner = CliRunner()


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--tp", "0"], "bad option tensor_parallel_size: Input should be greater than or equal to 1"),
        (["--concurrency", "1,x"], "bad option --concurrency '1,x'"),
        (["--concurrency", "0,4"], "bad option concurrency_levels"),
        (["--output-len", "1"], "bad option output_len"),
    ],
)
def test_bad_deploy_options_name_the_option(args, expected, tmp_path):
    result = runner.invoke(app, ["deploy", "org/model", "--models-root", str(tmp_path), *args])
    assert result.exit_code == 2
    assert expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []
