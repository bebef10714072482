"""`peagle bench`'s numeric flags are checked by argparse, before any model loads or anything is written: a K
outside the speculative config's 1..32 (K = -1 crashed a decode step with a traceback, K = 99 ran), a
concurrency, output length, prompt count or repeat count below 1 (--repeats 0 replaced OUT's results with an
empty run, then crashed in the goals table) are one usage line naming the flag."""
import pytest

from peagle.cli import main
from peagle.cli.bench import _ks


@pytest.mark.parametrize("flags, needle", [
    (["--ks", "-1"], 'K values are integers in 1..32 or "auto", got -1'),
    (["--ks", "0"], "got 0"),
    (["--ks", "3,99"], "got 99"),
    (["--ks", "1,abc"], "got abc"),
    (["--ks", ","], "got none"),
    (["--concurrency", "0"], "argument --concurrency: an integer >= 1, got '0'"),
    (["--concurrency", "1,x"], "got 'x'"),
    (["--repeats", "0"], "argument --repeats: an integer >= 1"),
    (["--output-len", "0"], "argument --output-len: an integer >= 1"),
    (["--num-prompts", "0"], "argument --num-prompts: an integer >= 1"),
    (["--threads", "-2"], "argument --threads: an integer >= 1"),
    (["--mask-token", "-1"], "argument --mask-token: an integer >= 0"),
])
def test_bench_numbers_out_of_range_stop_at_the_command_line(tmp_path, capsys, flags, needle):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        main(["bench", *flags, "--out", str(out)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err, err
    assert "Traceback" not in err and "invalid" not in err          # not argparse's "invalid _ks value"
    assert not out.exists()


def test_bench_ks_keeps_its_range_and_auto():
    """The edges of the range and "auto" pass, in the order given (negative control for the test above)."""
    assert _ks("1, auto ,32") == [1, "auto", 32]
