"""lab/measure/precision.py's write_report: the report's last line is a command that regenerates it."""
import shlex

from lab.measure.precision import write_report


def test_the_regenerate_line_splits_back_into_the_arguments(tmp_path, capsys):
    out = tmp_path / "r.md"
    argv = ["--prefill", "", "--paths", "q8_0a8=6,q4_1a8=6", "--note", "two words", "--out", str(out)]
    write_report(["# r"], "python lab/measure/x.py", argv, str(out))
    line = out.read_text().strip().splitlines()[-1]
    assert line.startswith("Regenerate: `") and line.endswith("`")
    got = shlex.split(line[len("Regenerate: `"):-1])
    assert got[:3] == ["python", "lab/measure/x.py", "--prefill"]
    assert got[3:-1] == argv[1:-1]                       # the empty value and the spaced one survive
    assert str(tmp_path) not in line and got[-1].endswith("r.md")   # no path of this machine
    assert capsys.readouterr().out.strip().endswith(line)
