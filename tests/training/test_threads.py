"""The trainer's CPU thread count (app.training.threads): the cores the engine and rollouts leave."""
from __future__ import annotations

import os

import pytest
import torch

from app.config import Settings
from app.training import threads
from app.training.teacher_scorers import LocalScorer


@pytest.mark.parametrize("cores, engine, want", [(2, 1, 1), (1, 1, 1), (16, 1, 14), (16, 4, 11), (3, 1, 1)])
def test_default_leaves_the_engine_threads_and_one_core_for_the_rollouts(cores, engine, want):
    assert threads.trainer_threads(Settings(engine_threads=engine), available=cores) == want


def test_an_explicit_count_wins():
    assert threads.trainer_threads(Settings(trainer_threads=6, engine_threads=1), available=2) == 6


def test_an_explicit_count_below_one_is_refused():
    with pytest.raises(ValueError):
        Settings(trainer_threads=0)


def test_cores_counts_this_process_affinity():
    assert 1 <= threads.cores() <= (os.cpu_count() or 1)


def test_apply_sets_torch_threads_on_cpu_and_leaves_them_on_cuda():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert threads.apply_cpu_threads(Settings(trainer_threads=1), device="cpu") == 1
        assert torch.get_num_threads() == 1
        assert threads.apply_cpu_threads(Settings(trainer_threads=3), device="cuda") is None
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_local_teacher_on_cpu_takes_the_trainer_thread_count():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads.trainer_threads() + 1)
        LocalScorer("tiny", device=torch.device("cpu"))
        assert torch.get_num_threads() == threads.trainer_threads()
        torch.set_num_threads(threads.trainer_threads() + 1)
        if torch.cuda.is_available():  # on a CUDA device the count is left as torch set it
            LocalScorer("tiny", device=torch.device("cuda"))
            assert torch.get_num_threads() == threads.trainer_threads() + 1
    finally:
        torch.set_num_threads(before)
