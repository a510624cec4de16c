"""examples/sft_warm_start.py: batches stay full across passes over the data (a short batch broke the
micro-batch split: --steps 313 on 20,000 records of batch 64 crashed)."""

import torch

from examples.sft_warm_start import batch_indices


def test_every_batch_is_full_and_each_pass_reshuffles():
    batches = list(batch_indices(20_000, 64, 313, torch.Generator().manual_seed(0)))
    assert len(batches) == 313 and all(len(b) == 64 for b in batches)
    per_pass = 20_000 // 64  # 312 full batches, then a new shuffle
    first_pass = [i for b in batches[:per_pass] for i in b]
    assert len(set(first_pass)) == len(first_pass)  # no record twice within a pass
    assert batches[per_pass] != batches[0]  # the second pass is a fresh order


def test_small_data_cycles_through_shuffles():
    batches = list(batch_indices(10, 4, 6, torch.Generator().manual_seed(0)))
    assert all(len(b) == 4 and len(set(b)) == 4 for b in batches)


def test_a_demonstration_without_answer_is_one_clear_line_before_the_model_loads(tmp_path, capsys):
    from examples.sft_warm_start import main

    data = tmp_path / "sft.jsonl"
    data.write_text('{"prompt": "3 1", "answer": "1 3"}\n{"prompt": "2 1"}\n')
    assert (
        main(
            [
                "--load",
                str(tmp_path / "no-model"),
                "--data",
                str(data),
                "--output",
                str(tmp_path / "out"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        f"--data {data}:2: needs string fields 'answer'" in err and not (tmp_path / "out").exists()
    )
