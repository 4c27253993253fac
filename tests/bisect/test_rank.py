"""bisect --rank on a job's rank, as docs/distributed.md gives it: exact every time.

Step 1 of a DDP job is DDP's second iteration, where it rebuilds its buckets with a broadcast
that often completes before the message log attaches its digest; that digest then ran on the
step's own thread under the operator capture, and the step's calls numbered otherwise on one
device than on the other (a structural difference in 4 of 6 runs on a busy machine). The
bisect runs three times in a row, each naming the operator, element and bit.
"""

from __future__ import annotations

import json

FAULT = "kind=bitflip,op=aten.mm,phase=backward,step=1,nth=0,index=3,bit=20,rank=1,device=cpu:1"


def test_bisect_on_rank_1_at_the_bucket_rebuild_names_the_flipped_bit_three_times_in_a_row(
    cli, tmp_path
):
    job = tmp_path / "J"
    recorded = cli(
        "record", "builtin:tiny-llama", "--nproc", "2", "--steps", "2", "-a", "dim=48",
        "--out", job,
    )  # fmt: skip
    assert recorded.exit_code == 0, recorded.output
    for run in range(3):
        result = cli(
            "bisect", job, "--rank", "1", "--suspect", "cpu:1", "--reference", "cpu:0",
            "--step", "1", "--inject", FAULT, "--out", tmp_path / f"report{run}", "--json",
        )  # fmt: skip
        assert result.exit_code == 1, (run, result.stderr)
        report = json.loads(result.stdout)
        site = (report["rank"], report["step"], report["phase"], report["module"], report["op"])
        assert site == (1, 1, "backward", "output", "aten.mm.default")
        assert report["isolated"] == "kernel"
        assert report["elements"]["indices"] == [3]
        assert report["bits"]["histogram"] == {"20": 1}
