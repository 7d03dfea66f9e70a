#!/usr/bin/env python
"""Mutation check: disable each guard and guarantee the README makes, once, and see a test fail.

Each entry of MUTATIONS names a file, an exact snippet of today's code, its replacement (the
guarantee disabled or broken; some entries edit several places), and the tests that must
catch it. The script copies the repository to a temporary directory once; for each mutation
it edits the copy, runs the named tests there (the copy comes first on PYTHONPATH, also for
subprocesses, DataLoader workers and torchrun), and restores the files. Nothing in the working
tree is touched.

Results: "killed" (a test failed: good), "SURVIVED" (every test passed: a test is missing or
weak), "stale" (the snippet no longer occurs exactly once, or a named test is gone: the code
moved on, update the entry), "error" (no test ran, or pytest itself failed). Entries with
`known` (say, ones whose test needs a GPU) are listed but not run. Exit status 1 if any
mutation survived, is stale or errs. It is not part of the test suite; run it by hand:

    python tools/mutate.py                    # every mutation (25-75 min on 2 shared cores)
    python tools/mutate.py skip rollback      # those whose name contains one of the words
    python tools/mutate.py --stale            # only check the snippets and the named tests
    python tools/mutate.py --list
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    edits: tuple[tuple[str, str, str], ...]  # (file, exact old snippet, new), in order
    tests: tuple[str, ...]  # pytest arguments: node ids or files
    known: Optional[str] = None  # why it cannot be run here (e.g. it needs a GPU): listed, not run


MUTATIONS: list[Mutation] = []


def mutation(name: str, file: str, old: str, new: str, *tests: str, known: Optional[str] = None,
             also: tuple[tuple[str, ...], ...] = ()) -> None:
    """`also`: more edits, (old, new) in `file` or (other file, old, new)."""
    edits = [(file, old, new)] + [(e[0], e[1], e[2]) if len(e) == 3 else (file, e[0], e[1]) for e in also]
    edits = [(_follow(f, o), o, n) for f, o, n in edits]
    tests = tuple(_follow_test(t) for t in tests)
    MUTATIONS.append(Mutation(name, edits[0][0], tuple(edits), tests, known))


def _follow(file: str, old: str) -> str:
    """`file`, or the one saferun module that now holds `old` when code moved (a refactor);
    a snippet found nowhere, or in several modules, stays put and is reported stale."""
    path = ROOT / file
    if path.is_file() and path.read_text().count(old) == 1:
        return file
    holders = [p for p in sorted((ROOT / "saferun").rglob("*.py")) if p.read_text().count(old) == 1]
    return str(holders[0].relative_to(ROOT)) if len(holders) == 1 else file


def _follow_test(test: str) -> str:
    """A test file moved to another folder (same file name) is followed there."""
    file, sep, rest = test.partition("::")
    if (ROOT / file).is_file():
        return test
    moved = sorted((ROOT / "tests").rglob(Path(file).name))
    return str(moved[0].relative_to(ROOT)) + sep + rest if len(moved) == 1 else test


T = "saferun/trainer.py"
BADSTEP, CKPTR = "saferun/guards/badstep.py", "saferun/checkpoint/checkpointer.py"
FORMATS = "saferun/checkpoint/formats.py"
EVAL, BATCHES = "saferun/loop/evaluation.py", "saferun/loop/batches.py"
COMPONENTS, COMPILE = "saferun/loop/components.py", "saferun/loop/compile.py"
STRATEGY, PREFLIGHT = "saferun/parallel/strategy.py", "saferun/guards/preflight.py"
MODES, STEP = "tests/unit/test_modes.py", "tests/unit/test_step.py"
NONFINITE, GUARDS = "tests/unit/test_nonfinite.py", "tests/test_guards.py"
RESUME, CKPT = "tests/resume/test_resume.py", "tests/resume/test_checkpoint.py"
DIFF = "tests/parity/test_differential.py::test_saferun_equals_the_reference_loop"
RANKS = "tests/distributed/test_rank_guarantees.py"

# ---------------------------------------------------------------- modes and evaluation
mutation("evaluation in eval mode", "saferun/modes.py",
         "    model.eval()\n    try:\n", "    try:\n",
         f"{MODES}::test_training_in_train_mode_and_eval_in_eval_mode_with_inference_mode")
mutation("evaluation under inference_mode", "saferun/modes.py",
         'grad_ctx = torch.inference_mode() if grad_mode == "inference_mode" else torch.no_grad()',
         "grad_ctx = torch.no_grad()",
         f"{MODES}::test_training_in_train_mode_and_eval_in_eval_mode_with_inference_mode")
mutation("eval_grad_mode=no_grad honoured", "saferun/modes.py",
         'grad_ctx = torch.inference_mode() if grad_mode == "inference_mode" else torch.no_grad()',
         "grad_ctx = torch.inference_mode()",
         f"{MODES}::test_no_grad_eval_mode_is_configurable")
mutation("every submodule's mode flag restored after evaluation", "saferun/modes.py",
         "            m.training = training\n", "            model.train()\n",
         f"{MODES}::test_validation_restores_every_submodule_flag_and_leaves_buffers_and_grads")
mutation("frozen modules stay in eval mode", "saferun/modes.py",
         "    for m in frozen:\n        m.eval()\n    return was_eval", "    return was_eval",
         f"{MODES}::test_frozen_module_stays_eval_without_grad_and_out_of_optimizer")
mutation("frozen modules get requires_grad=False", "saferun/modes.py",
         "        m.requires_grad_(False)\n", "        pass\n",
         f"{MODES}::test_frozen_module_stays_eval_without_grad_and_out_of_optimizer")
mutation("an optimizer holding frozen parameters is said (a warning)", T,
         "    check_optimizer_params(trainer.optimizer, model)\n", "",
         f"{MODES}::test_optimizer_over_all_parameters_with_a_frozen_part_warns_and_keeps_them")
mutation("fit puts the model in train mode", "saferun/modes.py",
         "    model.train()\n    for m in frozen:", "    for m in frozen:",
         f"{MODES}::test_model_loaded_in_eval_mode_is_put_in_train_mode_and_said_once")
mutation("fit says once that it left eval mode", "saferun/modes.py",
         "    return was_eval", "    return False",
         f"{MODES}::test_model_loaded_in_eval_mode_is_put_in_train_mode_and_said_once")
mutation("validation does not shift training's random streams", EVAL,
         "with self.evaluating(), preserved_rng():", "with self.evaluating():",
         f"{MODES}::test_randomness_in_validation_does_not_change_training")
mutation("predict runs in eval mode without autograd", EVAL,
         "        with self.evaluating():\n            for batch in loader:",
         "        with contextlib.nullcontext():\n            for batch in loader:",
         "tests/unit/test_predict.py::test_predict_returns_normal_cpu_tensors_in_order_without_changing_modes")

# ---------------------------------------------------------------- the step
# the one update after backward (loop/update.py): the single-optimizer step and each optimize()
UPD = "saferun/loop/update.py"
mutation("zero_grad(set_to_none=True)", UPD,
         "        release_grads(optimizer)  # zero_grad(set_to_none=True)\n",
         "        type(optimizer).zero_grad(optimizer, set_to_none=False)\n",
         f"{STEP}::test_grads_are_set_to_none_after_each_step")
mutation("clip after unscale", UPD,
         "            scaler.unscale_(optimizer)  # clip and measure the true gradients, not fp16-scaled ones\n",
         "            pass\n",
         f"{STEP}::test_gradients_are_unscaled_before_they_are_clipped_or_measured",
         also=(("        norm = grads.norm(self._max_grad_norm)\n",
                "        norm = grads.norm(self._max_grad_norm)\n        scaler.unscale_(optimizer)\n"),))
mutation("clip to max_grad_norm", UPD,
         "grads.norm(self._max_grad_norm)",
         "grads.norm(None)",
         f"{STEP}::test_clipping_uses_the_configured_norm_and_reports_the_pre_clip_norm")
GRADS = "tests/loop/test_gradients.py"
mutation("direct clip: torch's coefficient max_norm / (norm + 1e-6)", UPD,
         "(norm + 1e-6).reciprocal()", "(norm + 1e-5).reciprocal()",
         f"{GRADS}::test_the_norm_and_the_clipped_gradients_equal_torchs_bit_for_bit")
mutation("direct clip: the coefficient is clamped at 1", UPD,
         "_clamp((norm + 1e-6).reciprocal() * max_norm, max=1.0)", "(norm + 1e-6).reciprocal() * max_norm",
         f"{GRADS}::test_the_norm_and_the_clipped_gradients_equal_torchs_bit_for_bit")
mutation("direct clip: only one plain set of one dtype on one CPU or CUDA device", UPD,
         "not meshes and len(kinds) == 1", "not meshes and len(kinds) >= 1",
         f"{GRADS}::test_the_norm_and_the_clipped_gradients_equal_torchs_bit_for_bit",
         also=(('next(iter(kinds))[1].type in ("cpu", "cuda")', "True"),
               ("and all(type(p) is nn.Parameter for p in params)", "")))
mutation("direct clip: no graph, and the grad mode restored", UPD,
         "            _set_grad_enabled(grad_mode)", "            pass",
         f"{GRADS}::test_the_norm_records_no_graph_and_leaves_the_grad_mode_as_it_found_it")
mutation("direct clip: checked at each step (a part cast or moved mid-fit: torch's)", UPD,
         "        if not grads or set(map(_KIND, grads)) != self._kinds:",
         "        if not grads:",
         f"{GRADS}::test_a_part_cast_to_another_dtype_after_the_choice_gets_torchs_result_still",
         f"{GRADS}::test_a_block_cast_to_bf16_inside_training_step_trains_as_a_hand_written_loop")
mutation("release_grads: every gradient the optimizer holds", UPD,
         "                p.grad = None", "                pass",
         f"{GRADS}::test_releasing_sets_every_gradient_the_optimizer_holds_to_none")
mutation("release_grads: a class's own zero_grad runs", UPD,
         "if zero_grad is not _ZERO_GRAD or _profiling():", "if _profiling():",
         f"{GRADS}::test_an_optimizer_class_with_its_own_zero_grad_gets_it_called")
mutation("release_grads: torch's zero_grad under the profiler", UPD,
         "if zero_grad is not _ZERO_GRAD or _profiling():", "if zero_grad is not _ZERO_GRAD:",
         f"{GRADS}::test_under_the_profiler_torchs_zero_grad_runs_so_the_trace_names_it")
mutation("measure the norm without clip_grad_norm_(inf)", "saferun/loop/steps.py",
         "        return total_norm([p.grad for p in params if p.grad is not None], meshes)",
         '        return torch.nn.utils.clip_grad_norm_(params, float("inf"))',
         f"{STEP}::test_measuring_without_clipping_never_touches_gradients")
mutation("accumulation weights micro-batches", T,
         "        if share != 1.0:\n            loss, logs = loss * share",
         "        if False:\n            loss, logs = loss * share",
         f"{STEP}::test_accumulated_micro_batches_equal_one_large_batch", DIFF)
mutation("accumulation weights by share of samples, not by count", "saferun/loop/steps.py",
         "share = size / total if size != total else 1.0",
         "share = 1 / len(sizes) if size != total else 1.0",
         f"{STEP}::test_accumulated_micro_batches_equal_one_large_batch")
mutation("accumulation: DDP averages gradients after the last micro-batch only", "saferun/loop/steps.py",
         "forward_backward((batch,), share, i == len(sizes) - 1, size)",
         "forward_backward((batch,), share, True, size)",
         f"{RANKS}::test_no_gradient_all_reduce_before_a_steps_last_micro_batch")
mutation("accumulate micro-batches per optimizer step", BATCHES,
         "take(batches, self._t.accumulate)", "take(batches, 1)",
         f"{STEP}::test_accumulated_micro_batches_equal_one_large_batch")
mutation("scheduler steps once per optimizer step", T,
         "        (self._scaler.scale(loss) if self._update.scaling else loss).backward()\n",
         "        (self._scaler.scale(loss) if self._update.scaling else loss).backward()\n"
         "        if self.scheduler is not None:\n            self.scheduler.step()\n",
         f"{STEP}::test_scheduler_steps_once_per_optimizer_step")
mutation("bf16 autocast", "saferun/precision.py",
         '    if precision == "fp32":', '    if precision in ("fp32", "bf16"):',
         f"{STEP}::test_bf16_autocast_on_cpu")
mutation("fp16 refused on the CPU", "saferun/precision.py",
         '    if precision == "fp16" and device.type != "cuda":', "    if False:",
         f"{STEP}::test_fp16_on_cpu_is_refused_with_the_alternative")
mutation("max_steps (one step too many)", T,
         "                    if (control and control.stop) or (state.step >= limit and self._last_log_point()):",
         "                    if (control and control.stop) or (state.step > limit and self._last_log_point()):",
         "tests/test_event_order.py::test_two_epochs_with_logging_validation_and_checkpoints",
         also=(("while state.step < limit and (t.max_epochs",
                "while state.step <= limit and (t.max_epochs"),
               ("while state.step < limit and (group", "while state.step <= limit and (group"),
               ("            if state.step >= limit:\n                return",
                "            if state.step > limit:\n                return")))
mutation("max_epochs", T,
         "while state.step < limit and (t.max_epochs is None or state.epoch < t.max_epochs):",
         "while state.step < limit:",
         f"{STEP}::test_max_epochs_stops_after_that_many_passes", DIFF)
mutation("val_every_n_steps", T,
         "            epoch_end if every is None else state.step % every == 0)",
         "            epoch_end)",
         "tests/test_logging.py::test_tensorboard_has_every_metric_at_log_steps_and_the_config")
mutation("validation at each epoch's end", T,
         "            epoch_end if every is None else state.step % every == 0)",
         "            False if every is None else state.step % every == 0)",
         "tests/test_event_order.py::test_two_epochs_with_logging_validation_and_checkpoints")
mutation("limit_val_batches", T,
         "                if limit is not None and i >= limit:", "                if False:",
         "tests/unit/test_validation.py::test_limit_val_batches_uses_only_the_first_batches",
         "tests/unit/test_validation.py::test_limit_val_batches_limits_a_loader_the_user_built")
mutation("validation means weighted by batch size", "saferun/metrics.py",
         "            weighted = v.detach().float() * n", "            weighted = v.detach().float()",
         "tests/unit/test_validation.py::test_means_are_weighted_by_batch_size")

# ---------------------------------------------------------------- several optimizers
MANUAL, OPTS = "saferun/loop/manual.py", "tests/loop/test_optimizers.py"
HAND_WRITTEN = f"{OPTS}::test_each_update_equals_a_hand_written_loop_bitwise"
mutation("several optimizers: a loss's gradients only in its optimizer's parameters", MANUAL,
         "backward(inputs=params, retain_graph", "backward(retain_graph", HAND_WRITTEN)
mutation("several optimizers: unscale_ per optimizer before its clip", UPD,
         "            scaler.unscale_(optimizer)  #", "            pass  #", HAND_WRITTEN)
mutation("several optimizers: zero_grad(set_to_none=True) after each update", UPD,
         "        release_grads(optimizer)  # zero_grad(set_to_none=True)\n", "        pass\n", HAND_WRITTEN)
mutation("several optimizers: each scheduler steps after its optimizer", MANUAL,
         "self._update(opt, grads, self._schedule.by_name[name], loss)",
         "self._update(opt, grads, self._schedule.by_name[self.names[0]], loss)", HAND_WRITTEN)
mutation("the scheduler steps after the optimizer", UPD,
         "            schedule.after_step()  # steps the scheduler if the optimizer stepped (GradScaler)\n",
         "            pass\n", HAND_WRITTEN, "tests/unit/test_schedules.py")
mutation("several optimizers: gradients averaged over ranks", MANUAL,
         "            self._strategy.average(self.params[name], step)", "            pass",
         "tests/recipes/test_gan.py::test_torchrun_two_ranks_agree_and_equal_one_process_over_the_global_batch")
mutation("several optimizers: skip drops only the bad optimizer's update", UPD,
         "        skipped = guard.skips and guard.bad_now(loss, norm, spike)\n", "        skipped = False\n",
         f"{OPTS}::test_skip_policy_drops_only_the_bad_optimizers_update")
mutation("several optimizers: every optimizer (and scheduler) restored from a checkpoint", "saferun/loop/optimizers.py",
         "        for name, obj in self._by_name.items():\n            obj.load_state_dict(saved[name])",
         "        pass", f"{OPTS}::test_resume_restores_every_optimizer_by_name_and_refuses_renamed_ones")
mutation("several optimizers: a step must update each one", MANUAL,
         "        if missing:\n", "        if False:\n", f"{OPTS}::test_wrong_use_is_refused_with_what_to_do")
mutation("several optimizers: the spike guard refused", "saferun/loop/optimizers.py",
         '        "guards.spikes": (g.spikes != "off",', '        "guards.spikes": (False,',
         f"{OPTS}::test_the_spike_guard_is_refused_with_several_optimizers")
ERRS, CHECKS = "tests/loop/test_optimize_errors.py", "saferun/loop/manual_checks.py"
mutation("several optimizers: an error in training_step is explained", MANUAL,
         '            record(exc, phase="training", batch=batch)', '            pass',
         f"{ERRS}::test_an_error_in_training_step_is_explained_and_the_replay_changes_nothing")
mutation("several optimizers: the explanation's replay steps no optimizer", MANUAL,
         "        if self._replay is not None:\n            return self._replayed(name, loss)\n", "",
         f"{ERRS}::test_an_error_in_training_step_is_explained_and_the_replay_changes_nothing")
mutation("several optimizers: the explanation names the optimize() call that raised",
         "saferun/diagnose/explain_optimize.py",
         '    return f", in self.optimize({site.optimizer!r}, loss){part}"',
         '    return ""',
         f"{ERRS}::test_an_error_in_an_optimize_calls_backward_names_the_optimizer_and_the_line")
mutation("several optimizers: the ordering slip and a shared graph are named", MANUAL,
         "                if slip is None:\n", "                if True:\n",
         f"{ERRS}::test_the_ordering_slip_is_named_with_what_to_do_also_for_a_fused_optimizer",
         f"{ERRS}::test_a_shared_graph_is_named_with_the_options")
mutation("several optimizers: an ordering slip is told from an in-place op in the user's code",
         CHECKS, "            return None  # an in-place operation", "            pass  #",
         f"{ERRS}::test_an_error_in_an_optimize_calls_backward_names_the_optimizer_and_the_line")
mutation("several optimizers: updated parameters marked changed (fused optimizers)", MANUAL,
         "        increment_version(params)\n", "",
         f"{ERRS}::test_the_ordering_slip_is_named_with_what_to_do_also_for_a_fused_optimizer")
mutation("several optimizers: retain_graph reaches backward", MANUAL,
         "retain_graph=retain_graph)", ")",
         f"{ERRS}::test_retain_graph_gives_each_optimizer_the_gradient_of_the_loss_as_computed")
mutation("several optimizers: a loss that cannot train names the optimizer", CHECKS,
         "    if not loss.requires_grad:\n", "    if False:\n",
         f"{ERRS}::test_a_loss_that_cannot_train_names_the_optimizer_and_the_step")

# ---------------------------------------------------------------- host syncs
mutation("no host sync per step in the loop", T,
         "        self.state.advance(samples)\n        return StepOutput(loss=loss, grad_norm=grad_norm, logs=logs,",
         "        self.state.advance(samples)\n        float(loss)\n        return StepOutput(loss=loss, grad_norm=grad_norm, logs=logs,",
         "tests/unit/test_syncs.py::test_syncs_equal_log_points_plus_one_per_validation")
mutation("one host read per log point", "saferun/metrics.py",
         "            values = stacked.tolist()", "            values = [v.item() for v in stacked]",
         "tests/unit/test_syncs.py::test_syncs_equal_log_points_plus_one_per_validation")
mutation("the sync counter sees .item() of inference tensors", "saferun/syncs.py",
         "    torch.Tensor.item, torch.Tensor.tolist,", "    torch.Tensor.tolist,",
         "tests/unit/test_syncs.py::test_counter_sees_reads_of_inference_tensors_and_skips_optimizer_internals")
mutation("the sync counter counts each read once", "saferun/syncs.py",
         "        self.counter._in_read = True", "        self.counter._in_read = False",
         "tests/unit/test_syncs.py::test_counter_sees_reads_of_inference_tensors_and_skips_optimizer_internals")

# ---------------------------------------------------------------- seeding and data
mutation("worker seeds depend on the epoch", "saferun/seeding.py",
         "seed = derive_seed(self.seed, self.epoch, worker_id, self.rank)",
         "seed = derive_seed(self.seed, worker_id, self.rank)",
         "tests/unit/test_seeding.py::test_workers_and_epochs_draw_differently_and_reproducibly")
mutation("worker seeds depend on the worker", "saferun/seeding.py",
         "seed = derive_seed(self.seed, self.epoch, worker_id, self.rank)",
         "seed = derive_seed(self.seed, self.epoch, self.rank)",
         "tests/unit/test_seeding.py::test_workers_and_epochs_draw_differently_and_reproducibly")
mutation("workers seed NumPy from (seed, epoch, worker, rank)", "saferun/seeding.py",
         "        random.seed(seed)\n        np.random.seed(seed % 2**32)\n",
         "        random.seed(seed)\n", DIFF)
mutation("workers seed random from (seed, epoch, worker, rank)", "saferun/seeding.py",
         "        random.seed(seed)\n        np.random.seed(seed % 2**32)\n",
         "        np.random.seed(seed % 2**32)\n", DIFF)
mutation("the worker seeder learns the epoch", "saferun/data/__init__.py",
         "        loader.worker_init_fn.epoch = epoch", "        pass",
         "tests/unit/test_seeding.py::test_workers_and_epochs_draw_differently_and_reproducibly")
mutation("shuffle order from (seed, epoch)", "saferun/data/__init__.py",
         "loader.generator.manual_seed(derive_seed(seed, epoch, rank))",
         "loader.generator.manual_seed(derive_seed(seed, rank))", DIFF)
mutation("setup seeds Python's random", "saferun/seeding.py",
         "    random.seed(seed)\n    np.random.seed(seed % 2**32)\n    torch.manual_seed(seed)\n\n",
         "    np.random.seed(seed % 2**32)\n    torch.manual_seed(seed)\n\n", DIFF)
mutation("DistributedSampler's epoch is set", "saferun/data/__init__.py",
         "    if callable(set_epoch):  # DistributedSampler\n        set_epoch(epoch)",
         "    if callable(set_epoch):  # DistributedSampler\n        pass",
         "tests/unit/test_data.py::test_training_shards_are_disjoint_and_reshuffled_every_epoch")
mutation("validation shards without padding", "saferun/data/__init__.py",
         "        sampler = ShardSampler(n if limit is None else min(n, limit), rank, world_size)",
         "        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=False)",
         "tests/unit/test_data.py::test_validation_shards_hold_every_sample_exactly_once")
mutation("each rank seeds its own randomness", T,
         "            seed_everything(derive_seed(self.cfg.seed, data.rank))",
         "            pass", f"{RANKS}::test_ranks_draw_their_own_randomness_and_split_the_data_anew_every_epoch")
# ---------------------------------------------------------------- distributed
mutation("logged metrics averaged over ranks", "saferun/metrics.py",
         "            stacked[:averaged] /= world_size", "            pass",
         f"{RANKS}::test_logged_metrics_are_averaged_over_ranks")
mutation("validation metrics over every rank's shard", "saferun/loop/metrics.py",
         "        reduced = distributed.all_reduce(torch.stack([c.to(device) for c in columns]), group=group) \\\n",
         "        reduced = torch.stack([c.to(device) for c in columns]) \\\n",
         f"{RANKS}::test_validation_counts_every_sample_once")
mutation("no_sync on every micro-batch but the last", "saferun/distributed.py",
         '        with ddp.no_sync() if self.mode == "ddp" and not last else contextlib.nullcontext():',
         "        with contextlib.nullcontext():",
         f"{RANKS}::test_no_gradient_all_reduce_before_a_steps_last_micro_batch")
mutation("training forwards go through DDP", STRATEGY,  # DataParallel falls back to no context
         "    @contextlib.contextmanager\n    def micro_batch(self, last: bool) -> Iterator[None]:\n"
         '        """Average the gradients',
         "    @contextlib.contextmanager\n    def _micro_batch_unused(self, last: bool) -> Iterator[None]:\n"
         '        """Average the gradients',
         f"{RANKS}::test_no_gradient_all_reduce_before_a_steps_last_micro_batch")
mutation("find_unused_parameters reaches DDP", STRATEGY,
         "ddp.GradientSync(self._module, self._device, self._find_unused,",
         "ddp.GradientSync(self._module, self._device, False,",
         f"{RANKS}::test_logged_metrics_are_averaged_over_ranks")
mutation("every rank's RNG state in the checkpoint", CKPTR,
         "        per_rank = p.strategy.gather(mine)", "        per_rank = [mine]",
         f"{RANKS}::test_resuming_with_another_number_of_processes_is_refused")
mutation("resume needs the same number of processes", CKPTR,
         '        if saved != tuple(p.strategy.layout):', "        if False:",
         f"{RANKS}::test_resuming_with_another_number_of_processes_is_refused")
mutation("only rank 0 writes event files", COMPONENTS,
         'for key in ("callbacks", "logger") if is_main else ("callbacks",):',
         'for key in ("callbacks", "logger"):',
         "tests/distributed/test_torchrun.py::test_ranks_agree_and_equal_one_process_over_the_same_global_batch")
mutation("a NaN on any rank is bad on every rank", "saferun/metrics.py",
         "        codes = distributed.all_reduce(torch.stack(rows).int()",
         "        codes = (lambda t, op: t)(torch.stack(rows).int()",
         "tests/distributed/test_torchrun.py::test_a_nan_on_one_rank_stops_every_rank_at_the_same_step")
mutation("a stop signal on one rank stops every rank", "saferun/parallel/agreement.py",
         "        if votes:\n", "        if False:\n",
         "tests/distributed/test_torchrun.py::test_sigterm_on_one_rank_stops_all_ranks_at_the_same_step")
mutation("a user loader under torchrun must split the data", "saferun/data/__init__.py",
         "    if world_size == 1 or world_size in (getattr(sampler",
         "    if True or world_size in (getattr(sampler",
         "tests/parallel/test_ddp_paths.py::test_a_user_loader_that_does_not_split_the_data_is_refused")

# ---------------------------------------------------------------- checkpoints and resume
mutation("GradScaler state saved", CKPTR,
         '            "scaler": p.scaler.state_dict(),', '            "scaler": {},',
         f"{CKPT}::test_grad_scaler_state_is_saved_and_restored")
mutation("GradScaler state restored", T,
         '        if state["scaler"]:\n', "        if False:\n",
         f"{CKPT}::test_grad_scaler_state_is_saved_and_restored")
mutation("resume restores the RNG states", BATCHES,
         "                set_rng_state(self.resume_rng)\n", "                pass\n",
         f"{RESUME}::test_resume_in_process_equals_straight_run_without_workers", DIFF)
mutation("resume restores every RNG (NumPy)", "saferun/seeding.py",
         "    np.random.set_state((", "    id((", DIFF)
mutation("resume replays the data position", T,
         "itertools.islice(batches, state.batches_in_epoch)", "itertools.islice(batches, 0)",
         f"{RESUME}::test_resume_in_process_equals_straight_run_without_workers", DIFF)
mutation("resume restores the metrics pending since the last log point", CKPTR,
         '        p.running.load_state_dict(move_to_device(mine["running"], o.device))\n', "",
         DIFF)
mutation("resume restores the optimizer", FORMATS,
         '        optimizer.load_state_dict(state["optimizer"])\n', "        pass\n", DIFF)
mutation("resume restores the scheduler", CKPTR,
         '            p.scheduler.load_state_dict(state["scheduler"])\n', "            pass\n", DIFF)
mutation("resume restores the loop counters", "saferun/loop/state.py",
         '        for key in ("step", "epoch", "batches_in_epoch", "samples_seen"):\n'
         "            setattr(self, key, loop[key])\n",
         '        for key in ("step",):\n            setattr(self, key, loop[key])\n',
         # setup already set them for a resume; a rollback needs them (samples_seen)
         f"{NONFINITE}::test_rollback_resumes_from_the_newest_checkpoints_weights_with_the_data_after_the_bad_step")
mutation("callback state saved", CKPTR,
         '            "callbacks": p.callbacks.state_dict(),', '            "callbacks": {},',
         f"{CKPT}::test_callback_state_round_trips_through_a_checkpoint")
mutation("spike detector state saved", CKPTR,
         '"spikes": p.spikes.state_dict() if p.spikes is not None else {},',
         '"spikes": {},',
         f"{GUARDS}::test_spike_detector_state_survives_checkpoint_and_resume")
mutation("weights_only=True", "saferun/checkpoint.py",
         "torch.load(f, map_location=map_location, weights_only=True)",
         "torch.load(f, map_location=map_location, weights_only=False)",
         f"{CKPT}::test_a_crafted_checkpoint_is_refused_and_its_code_never_runs")
mutation("state checked to load safely before writing", "saferun/checkpoint.py",
         "    check_plain(state)\n", "",
         f"{CKPT}::test_state_that_would_not_load_safely_is_refused_at_save_time")
mutation("hashes verified on load", "saferun/checkpoint.py",
         '    if (size, actual) != (expected["bytes"], expected["sha256"]):', "    if False:",
         f"{CKPT}::test_corrupted_newest_checkpoint_falls_back_to_the_previous_with_a_warning")
mutation("a checkpoint without manifest is incomplete", "saferun/checkpoint.py",
         '    if not storage.isfile(path / "manifest.json"):', "    if False:",
         f"{CKPT}::test_a_checkpoint_without_manifest_is_incomplete")
mutation("files fsynced", "saferun/checkpoint.py",
         "            yield f\n            f.flush()\n            os.fsync(f.fileno())\n",
         "            yield f\n            f.flush()\n",
         f"{CKPT}::test_files_and_directories_are_fsynced_before_the_checkpoint_appears")
mutation("the temporary directory fsynced before the rename", "saferun/checkpoint/store.py",
         "        fsync_dir(tmp)\n        old = None\n", "        old = None\n",
         f"{CKPT}::test_files_and_directories_are_fsynced_before_the_checkpoint_appears")
mutation("the parent fsynced after the rename", "saferun/checkpoint/store.py",
         "        os.replace(tmp, final)\n        fsync_dir(final.parent)\n",
         "        os.replace(tmp, final)\n",
         f"{CKPT}::test_files_and_directories_are_fsynced_before_the_checkpoint_appears")
mutation("written under a temporary name", "saferun/checkpoint.py",
         '    tmp = root / f".tmp-step-{step:08d}-{secrets.token_hex(4)}"\n', "    tmp = final\n",
         f"{CKPT}::test_files_and_directories_are_fsynced_before_the_checkpoint_appears")
mutation("temporary directories are never taken for checkpoints", "saferun/checkpoint.py",
         "if (m := _STEP_DIR.match(name)) and storage.isdir(root / name)]",
         'if (m := re.search(r"step-(\\d{8,})", name)) and storage.isdir(root / name)]',
         f"{CKPT}::test_a_writer_killed_mid_save_leaves_the_previous_checkpoint_intact")
mutation("old checkpoints deleted only after the new one is complete", CKPTR,
         "        formatted.save(root, o.state.step, state, p.model, p.optimizer, rotation, self.storage)\n",
         "        for old in self.list()[:max(len(self.list()) + 1 - t.keep_last, 0)]:\n"
         "            __import__('shutil').rmtree(old)  # make room first\n"
         "        formatted.save(root, o.state.step, state, p.model, p.optimizer, rotation, self.storage)\n",
         f"{CKPT}::test_a_failed_save_leaves_the_previous_checkpoints")
mutation("keep_last", "saferun/checkpoint.py",
         "listed[:-keep_last]", "listed[:-keep_last - 1]",
         f"{CKPT}::test_keep_last_and_best")
mutation("save_best keeps the best", CKPTR,
         "keep=[Path(self.best.checkpoint)] if self.best else (), current=done,", "keep=(), current=done,",
         f"{CKPT}::test_keep_last_and_best")
mutation("model.pt holds the final weights", CKPTR,
         '            files = {f"model{suffix}.pt": weights}\n',
         "            files = {}\n",
         f"{CKPT}::test_a_checkpoint_holds_the_whole_training_state")
mutation("resume=auto starts fresh without a checkpoint", T,
         '            if resume != "auto":\n', "            if True:\n",
         f"{RESUME}::test_resume_auto_without_checkpoint_starts_fresh_and_explicit_path_must_exist")
mutation("resume refuses a config that changes results", CKPTR,
         '        check_resume_config(state["config"], config, o.cfg.force_resume)\n', "",
         f"{RESUME}::test_resume_with_a_different_config_is_refused_naming_the_keys")
mutation("force_resume overrides", "saferun/config.py",
         "    if not changed or force:", "    if not changed:",
         f"{RESUME}::test_resume_with_a_different_config_is_refused_naming_the_keys")
for _key, _old, _new in [
        ("seed", 'EXACTNESS_KEYS = ("seed", ', "EXACTNESS_KEYS = ("),
        ("data", '"seed", "model", "data", "collate_fn"', '"seed", "model", "collate_fn"'),
        ("collate_fn", '"data", "collate_fn", "task"', '"data", "task"'),
        ("optim", '"task", "optim", "sched"', '"task", "sched"'),
        ("sched", '"optim", "sched",\n', '"optim",\n'),
        *[(f"trainer.{k}", f'"trainer.{k}",', "") for k in (
            "batch_size", "accumulate", "num_workers", "shuffle", "drop_last", "precision",
            "frozen_modules")],
        ("trainer.max_grad_norm", '"trainer.max_grad_norm", ', ""),
        ("guards.nonfinite", '"guards.nonfinite", ', ""),
        ("guards.spikes", '"guards.nonfinite", "guards.spikes",', '"guards.nonfinite",')]:
    mutation(f"resume refuses a changed {_key}", "saferun/config.py", _old, _new,
             f"{RESUME}::test_each_setting_that_changes_results_refuses_resume")
for _key, _kept in (("model", "task"), ("task", "model")):  # setup checks these two on their own
    mutation(f"resume refuses a changed {_key} (both checks)", T,
             'keys=("model", "task"), purpose=', f'keys=("{_kept}",), purpose=',
             f"{RESUME}::test_each_setting_that_changes_results_refuses_resume",
             also=(("saferun/config.py", '"seed", "model", ' if _key == "model" else
                    '"collate_fn", "task", ', '"seed", ' if _key == "model" else '"collate_fn", '),))
mutation("resume=PATH sets the run's newer checkpoints aside", CKPTR,
         '        changed = course.change_course(',
         '        changed = None and course.change_course(',
         f"{RESUME}::test_resume_from_an_older_checkpoint_sets_the_newer_ones_aside")

# ---------------------------------------------------------------- non-finite guard
mutation("non-finite loss raises at log points", BADSTEP,
         '        if self.nonfinite_policy.checked and not all(',
         '        if False and not all(',
         f"{NONFINITE}::test_raise_names_the_step_and_the_samples_with_no_per_step_sync")
mutation("non-finite gradients are checked", BADSTEP,
         '(("train/grad_norm",) if self.grads_checked else ())', "()",
         f"{NONFINITE}::test_a_non_finite_gradient_under_a_finite_loss_is_caught")
mutation("checked before each save", T,
         "        bad = guard.window_bad() or guard.state_bad(checkpointer.path())",
         "        bad = guard.state_bad(checkpointer.path())",
         f"{NONFINITE}::test_no_checkpoint_is_written_after_a_non_finite_step")
mutation("checked before each validation", T,
         "        if not self._window_good():\n            return None  # rolled back",
         "        if False:\n            return None  # rolled back",
         f"{NONFINITE}::test_a_non_finite_step_is_caught_before_validation")
mutation("check_params adds the parameters", T,
         "            guards.register(ParamNorm(self._params, self._strategy.meshes))",
         "            pass",
         f"{NONFINITE}::test_non_finite_parameters_are_named_when_check_params_is_on")
mutation("non-finite parameters are bad", T,
         'keys = ("train/loss", "train/param_norm") +', 'keys = ("train/loss",) +',
         f"{NONFINITE}::test_non_finite_parameters_are_named_when_check_params_is_on")
mutation("skip drops the bad update", UPD,
         "        skipped = guard.skips and guard.bad_now(loss, norm, spike)\n", "        skipped = False\n",
         f"{NONFINITE}::test_skip_leaves_the_model_and_optimizer_exactly_as_before_the_step")
mutation("skip restores the buffers (BatchNorm statistics)", BADSTEP,
         "        self.snapshot.restore()\n", "",
         f"{NONFINITE}::test_a_skipped_nan_batch_leaves_no_nan_in_the_batchnorm_statistics", DIFF)
mutation("skip leaves the scheduler untouched", UPD,
         "            schedule.after_step()  # steps the scheduler if the optimizer stepped (GradScaler)\n",
         "            schedule.after_step()\n            if skipped:\n"
         "                schedule.scheduler.step()\n",
         f"{NONFINITE}::test_skip_leaves_the_optimizer_and_the_schedule_one_step_behind")
mutation("skip drops the bad gradients", UPD,
         "        release_grads(optimizer)  # zero_grad(set_to_none=True)\n",
         "        if not skipped:\n            release_grads(optimizer)\n",
         f"{NONFINITE}::test_skip_leaves_the_optimizer_and_the_schedule_one_step_behind")
mutation("skip stops after max_consecutive", BADSTEP,
         "        if self._skips_in_a_row >= self._g.max_consecutive:", "        if False:",
         f"{NONFINITE}::test_skip_stops_after_too_many_in_a_row")
mutation("rollback restores the newest checkpoint", CKPTR,
         "        for path in reversed(self.list()):  # newest first\n",
         "        for path in self.list():  # newest first\n",
         f"{NONFINITE}::test_rollback_resumes_from_the_newest_checkpoints_weights_with_the_data_after_the_bad_step")
mutation("rollback restores the weights", CKPTR,
         "            self.restore(state)\n            bad = unclean()",
         '            self.restore({**state, "model": {k: torch.randn_like(v) if v.is_floating_point() '
         'else v for k, v in state["model"].items()}})\n            bad = unclean()',
         f"{NONFINITE}::test_rollback_resumes_from_the_newest_checkpoints_weights_with_the_data_after_the_bad_step")
mutation("rollback gives up after max_consecutive", BADSTEP,
         "        if self._rollbacks > self._g.max_consecutive:\n            raise NonFiniteError(",
         "        if False:\n            raise NonFiniteError(",
         f"{NONFINITE}::test_rollback_without_recovery_gives_up")
mutation("rollback keeps a step-0 checkpoint", T,
         "            self._checkpointer.ensure_one(self._save)  # so there is always a good state to go back to",
         "            pass",
         f"{NONFINITE}::test_rollback_restores_the_last_checkpoint_and_goes_on")
mutation("anomaly replay keeps a step-0 checkpoint", T,
         '                                 or self.spike_policy.needs_checkpoint or g.anomaly_replay)',
         '                                 or self.spike_policy.needs_checkpoint)',
         f"{NONFINITE}::test_anomaly_replay_names_the_backward_op_and_its_forward_line")
mutation("anomaly replay", BADSTEP,
         "        return (self._g.anomaly_replay and bad.kind == \"non-finite\" and not bad.bad_input",
         "        return (False and bad.kind == \"non-finite\" and not bad.bad_input",
         f"{NONFINITE}::test_anomaly_replay_names_the_backward_op_and_its_forward_line")
mutation("unused parameters named", T,
         "            guards.register(UnusedParameters(self.model.named_parameters(),",
         "            id(UnusedParameters(self.model.named_parameters(),",
         f"{NONFINITE}::test_unused_parameters_are_named_once")

mutation("a parameter made trainable mid-run is refused", T,
         "        guards.register(self._trainable)",
         "        id(self._trainable)",
         "tests/guards/test_trainable.py::test_a_module_of_frozen_modules_unfrozen_mid_run_is_refused_at_the_next_log_point")
mutation("the trainable set counts only parameters that require grad", "saferun/guards/trainable.py",
         "                if id(p) not in self.known and (p.requires_grad or p.grad is not None or (",
         "                if id(p) not in self.known and (True or p.grad is not None or (",
         "tests/unit/test_modes.py::test_optimizer_over_all_parameters_with_a_frozen_part_warns_and_keeps_them")
mutation("the trainable set sees a parameter trained on some steps by the gradient it got",
         "saferun/guards/trainable.py",
         "                if id(p) not in self.known and (p.requires_grad or p.grad is not None or (",
         "                if id(p) not in self.known and (p.requires_grad or False or (",
         "tests/guards/test_trainable.py::test_a_module_unfrozen_inside_training_step_and_frozen_at_log_points_is_refused")

mutation("the trainable set sees a part of the user's optimizer stepped on some steps by its state",
         "saferun/guards/trainable.py",
         "                    id(p) not in self.held_before and any(p in o.state for o in self.optimizers)))]",
         "                    False))]",
         "tests/guards/test_trainable.py::test_a_module_in_the_users_optimizer_switched_on_inside_training_step_is_refused")
mutation("the trainable set counts the optimizer state held at the start (a resume's) as no update",
         "saferun/guards/trainable.py",
         "        self.held_before = {id(p) for opt in self.optimizers for p in opt.state}",
         "        pass",
         "tests/guards/test_trainable.py::test_freezing_at_a_resume_is_fine_though_the_optimizer_holds_state_for_the_frozen_part")
mutation("several optimizers: one over frozen parameters only is refused at setup",
         "saferun/loop/optimizers.py",
         "    check_some_trainable(named, model)\n", "",
         "tests/loop/test_optimize_errors.py::test_an_optimizer_over_only_frozen_parameters_is_refused_at_setup")

# ---------------------------------------------------------------- spikes
mutation("spikes detected at their step (a skip policy)", UPD,
         "        spike, loss_spike = guard.spike(loss, norm) if guard.spikes_each_step else (None, None)",
         "        spike, loss_spike = None, None",
         f"{GUARDS}::test_a_loss_spike_can_be_skipped")
mutation("spikes compared at log points (raise, rollback)", T,
         "            self._running.spike_flagger = self._guard.flag_steps  # compared at log points",
         "            pass",
         f"{GUARDS}::test_a_loss_spike_raises_naming_the_step")
mutation("spikes: a step's flag only where a skip policy needs it then", BADSTEP,
         "        self.spikes_each_step = self.spikes is not None and self.skips",
         "        self.spikes_each_step = self.spikes is not None",
         "tests/loop/test_loop_cost.py::test_strict_guards_dispatch_no_torch_operator_on_a_plain_step")
mutation("spikes: the kept steps flagged before a save and a read", "saferun/loop/metrics.py",
         "(so a resumed run logs the same means).\"\"\"\n        self.catch_up()\n",
         "(so a resumed run logs the same means).\"\"\"\n",
         f"{GUARDS}::test_a_resume_from_between_log_points_compares_the_same_steps_as_one_run",
         also=(("        self.catch_up()\n        if self.loss_spikes:", "        if self.loss_spikes:"),
               (CKPTR, "        p.running.catch_up()  # the steps'", "        pass  # the steps'")))
mutation("spikes: a check between log points flags the steps before it", "saferun/loop/metrics.py",
         "        self.catch_up()\n        if self.loss_spikes:", "        if self.loss_spikes:",
         f"{GUARDS}::test_a_spike_before_a_validation_between_log_points_rolls_back_as_per_step_flags_did")
mutation("spikes: a window's steps from before the guard was on are unflagged", "saferun/loop/metrics.py",
         "    return flags if missing <= 0 else torch.cat(",
         "    return flags if True else torch.cat(",
         f"{GUARDS}::test_turning_the_spike_guard_on_at_a_resume_between_log_points_checks_the_later_steps")
mutation("spikes: update_many compares each value with the limit update would", "saferun/guards/spikes.py",
         "            take = min(self._due, n - i)  # the values `update` compares with this limit",
         "            take = n - i",
         "tests/guards/test_spikes.py::test_update_many_flags_and_keeps_exactly_what_one_update_per_value_does")
mutation("a rollback at the run's last log point trains on to the limit", T,
         "        return self.state.step == step\n", "        return True\n",
         f"{GUARDS}::test_a_spike_in_the_steps_after_the_last_log_point_rolls_back_and_trains_on_to_max_steps")
mutation("callback states keyed by class and place among that class, not the list's index",
         "saferun/callbacks.py", '        keys.append(f"{seen.get(name, 0)}:{name}")',
         '        keys.append(f"{len(keys)}:{name}")',
         "tests/checkpoint/test_checkpoint.py::test_a_resume_with_a_callback_added_or_removed_gives_each_callback_its_own_state")
mutation("callback states keyed by state_key too: two EarlyStopping swapped keep their own",
         "saferun/callbacks.py", '        own = None if bare else getattr(cb, "state_key", None)',
         "        own = None",
         "tests/checkpoint/test_checkpoint.py::test_two_early_stoppings_swapped_at_a_resume_each_continue_their_own_metric")
mutation("a second fit() refuses a parameter replaced since the optimizer was built",
         "saferun/loop/steps.py", "    if new:\n        raise SaferunError(\n            f\"fit(): the model's",
         "    if False:\n        raise SaferunError(\n            f\"fit(): the model's",
         "tests/loop/test_loop_edges.py::test_a_second_fit_after_a_parameter_was_replaced_is_refused_naming_it")
mutation("a run that ends at the checkpoint it rolled back to validates those weights", T,
         "        if self.state.validated_at != self.state.step:\n",
         "        if False:\n",
         "tests/guards/test_nonfinite.py::test_a_run_that_ends_at_the_checkpoint_it_rolled_back_to_validates_those_weights")
mutation("each fit() says only its own rollback at the end", T,
         "        self._guard.rolled_back_from = 0  #", "        pass  #",
         "tests/guards/test_nonfinite.py::test_a_second_fit_after_a_run_ended_before_its_rollback_does_not_say_it_again")
mutation("under torchrun only rank 0 says dropped callback states (the loggers are its alone)",
         "saferun/callbacks.py", "        if dropped and say_dropped:\n", "        if dropped:\n",
         "tests/parallel/test_torchrun.py::test_a_resume_with_the_same_loggers_says_nothing_of_dropped_callback_states")
mutation("fit() lets the gradient accumulators go when it returns", T,
         "        self._accumulators: list[Any] = []", "        pass",
         "tests/loop/test_loop_cost.py::test_a_finished_trainer_whose_hooks_refer_to_it_is_freed")
mutation("a saved callback state no callback takes is said", "saferun/callbacks.py",
         "        if dropped and say_dropped:\n", "        if False:\n",
         "tests/checkpoint/test_checkpoint.py::test_a_resume_with_a_callback_added_or_removed_gives_each_callback_its_own_state")
mutation("a resume with another number of CPU threads is said", CKPTR,
         '        _say_other_threads(state.get("provenance", {}).get("threads"), o.device)\n', "",
         "tests/checkpoint/test_resume.py::test_a_resume_with_another_number_of_threads_says_it_may_round_differently")
mutation("a rollback the run ends before says that the run ends at the checkpoint", T,
         "        if self._guard.rolled_back_from > self.state.step:",
         "        if False:",
         "tests/guards/test_nonfinite.py::test_a_rollback_after_the_last_epochs_last_step_says_the_run_ends_there")
mutation("spikes: a resume with another spike_window refused naming the key", CKPTR,
         "                _check_spike_window(saved, p.spikes.window)\n", "                pass\n",
         f"{GUARDS}::test_a_resume_with_another_spike_window_is_refused_naming_the_key")
mutation("spikes raise at log points", BADSTEP,
         '        return metrics.get("train/spikes", 0.0) == 0.0 or self.spike_policy.skips',
         "        return True",
         f"{GUARDS}::test_a_loss_spike_raises_naming_the_step")
mutation("spikes skipped", BADSTEP,
         '        self.skip_spikes = self.spike_policy.skips', "        self.skip_spikes = False",
         f"{GUARDS}::test_a_loss_spike_can_be_skipped")

# ---------------------------------------------------------------- eval purity, modes, preflight
mutation("eval purity: changed parameters and buffers", EVAL,
         '        probe = {"changed": purity_changed(before, fingerprint(self._model))} if before else {}',
         "        probe = {}",
         f"{GUARDS}::test_evaluation_that_changes_the_model_is_named")
mutation("eval purity: inference tensors left on the model", "saferun/guards/purity.py",
         "        problems += find_inference_tensors(  # metadata only: no sync\n",
         "        problems += [] if True else find_inference_tensors(  # metadata only: no sync\n",
         f"{GUARDS}::test_evaluation_that_changes_the_model_is_named")
mutation("eval purity in predict", EVAL,
         "            check_purity(before, self._model, float(purity_changed(before, fingerprint(self._model))),\n"
         "                         self._grad_mode, step)",
         "            pass",
         f"{GUARDS}::test_predict_that_changes_the_model_is_named")
mutation("eval purity checksums see moved values", "saferun/purity.py",
         "chunk[1::2].sum(dtype=acc)])", "chunk.sum(dtype=acc)])",
         "tests/unit/test_purity.py")
mutation("declared modes checked every step", T,
         "            guards.register(modes.DeclaredModes(self.model, self._frozen))",
         "            pass",
         f"{GUARDS}::test_a_frozen_module_put_back_in_train_mode_is_named",
         f"{GUARDS}::test_a_module_switched_to_eval_during_training_is_named")
mutation("declared modes: each module's mode read", "saferun/modes.py",
         "        return list(map(_TRAINING, self.modules))  # C calls only: ~30 ns per module",
         "        return list(self.expected)",
         f"{GUARDS}::test_a_frozen_module_put_back_in_train_mode_is_named",
         f"{GUARDS}::test_a_module_switched_to_eval_during_training_is_named")
mutation("a flat tuple batch stays a tuple on the device", "saferun/data/transfer.py",
         "            return moved if type(batch) is list else tuple(moved)", "            return moved",
         "tests/unit/test_data.py::test_a_flat_tuple_or_list_of_tensors_is_moved_and_keeps_its_type")
mutation("a CPU batch list skipped by the move is still a new list", "saferun/data/transfer.py",
         "            return batch if type(batch) is tuple else batch.copy()", "            return batch",
         "tests/loop/test_loop_edges.py::"
         "test_a_training_step_that_rewrites_its_batch_list_leaves_the_loaders_batch_alone",
         "tests/unit/test_data.py::test_a_batch_already_on_the_cpu_is_not_moved_and_one_that_is_not_still_is")
mutation("preflight errors stop the run", PREFLIGHT,
         "            report.raise_errors()", "            pass",
         f"{GUARDS}::test_spawn_workers_with_a_lambda_are_stopped_before_the_first_step")
mutation("preflight warnings are shown", PREFLIGHT,
         '                log.warning("DataLoader preflight: %s", warning)',
         "                pass",
         f"{GUARDS}::test_fork_workers_with_a_lambda_train_but_get_a_warning")
mutation("preflight finds generator objects", PREFLIGHT,
         "        found: list[tuple[Finding, Any]] = []\n        scan_rng(obj, attr, found, set(), 0)\n",
         "        found: list[tuple[Finding, Any]] = []\n",
         f"{GUARDS}::test_a_generator_object_on_the_dataset_is_reported_once")
mutation("the start method reaches the DataLoader", "saferun/data/__init__.py",
         "multiprocessing_context=multiprocessing_context if num_workers > 0 else None)",
         "multiprocessing_context=None)",
         f"{GUARDS}::test_spawn_workers_with_a_lambda_are_stopped_before_the_first_step")
mutation("worker batches must be on the CPU", T,
         "                    check_batch_on_cpu(group[0])  # what the first worker batch holds",
         "                    pass",
         "tests/cuda/test_cuda.py", known="needs a CUDA GPU (tests/cuda); on the CPU no worker can return a CUDA tensor")
mutation("sync audit wired in", COMPONENTS,
         "        callbacks.append(SyncAudit(device_type))  # last: it sees every callback's syncs",
         "        pass",
         f"{GUARDS}::test_sync_audit_names_a_per_step_item_in_user_code")

# ---------------------------------------------------------------- compile, errors, config
mutation("compiled model checked against eager", COMPILE,
         "        check_compiled(eval_loss, rtol, atol)", "        pass",
         "tests/unit/test_compile.py::test_compiled_output_that_differs_from_eager_stops_the_run_with_both_values",
         also=(("        check_compiled_training(train_loss, model, rtol, atol)", "        pass"),))
mutation("the compiled training graph checked against eager", COMPILE,
         "        check_compiled_training(train_loss, model, rtol, atol)", "        pass",
         "tests/unit/test_compile.py::test_a_training_graph_that_differs_from_eager_stops_the_run")
mutation("compiled in place: no _orig_mod. keys", T,
         "            self.model.compile(backend=t.compile_backend)",
         "            self.model = torch.compile(self.model, backend=t.compile_backend)",
         "tests/unit/test_compile.py::test_a_model_compiled_by_the_user_is_unwrapped")
mutation("a model compiled by the user is unwrapped", T,
         "        model = unwrap_compiled(model)\n", "",
         "tests/unit/test_compile.py::test_a_model_compiled_by_the_user_is_unwrapped")
mutation("an inference tensor used in training is explained", T,
         'if isinstance(exc, RuntimeError) and "Inference tensors cannot be saved" in str(exc):',
         "if False:",
         "tests/unit/test_bad_input.py::test_inference_tensor_kept_from_validation_is_explained")
mutation("config: positive values", "saferun/config.py",
         '        _positive(self, "batch_size", "accumulate", "log_every_n_steps", "keep_last",\n'
         '                  "collective_timeout")\n',
         "", "tests/unit/test_config.py")
mutation("config: choices", "saferun/config.py",
         '        _one_of(self, "precision", PRECISIONS)\n', "", "tests/unit/test_config.py")
mutation("config: _target_ arguments checked", "saferun/config.py",
         "    check_target_signature(key, node)\n", "", "tests/unit/test_config.py")
mutation("config: negative learning rate", "saferun/config.py",
         "        if isinstance(lr, (int, float)) and lr < 0:", "        if False:",
         "tests/unit/test_config.py")
mutation("components built from their config nodes", T,
         '        return instantiate_node("optim", self.cfg.optim, params=params)',
         "        return torch.optim.AdamW(params)",
         "tests/configs/test_compose_all.py")
mutation("configured callbacks and loggers built", COMPONENTS,
         "            if node is not None:\n                callbacks.append(",
         "            if False:\n                callbacks.append(",
         "tests/configs/test_compose_all.py")

# ---------------------------------------------------------------- callbacks and logging
mutation("the Controls of several callbacks are combined", "saferun/callbacks.py",
         "    return a | b", "    return a",
         "tests/test_event_order.py::test_the_controls_of_several_callbacks_at_a_log_point_are_combined")
mutation("the Controls of several callbacks are combined at the end of a step", "saferun/callbacks.py",
         "control = asked if control is None else control | asked",
         "control = asked if control is None else control",
         "tests/test_event_order.py::test_the_controls_of_several_callbacks_are_combined")
mutation("Control(save=True) saves", T,
         "        if (control and control.save) or (\n",
         "        if False or (\n",
         "tests/test_event_order.py::test_the_controls_of_several_callbacks_are_combined")
mutation("Control(evaluate=True) validates", T,
         "        if due or (control and control.evaluate):",
         "        if due:",
         "tests/test_event_order.py::test_evaluate_request_runs_validation_after_that_step")
mutation("Control(stop=True) stops", T,
         "                    if (control and control.stop) or (state.step >= limit and self._last_log_point()):",
         "                    if state.step >= limit and self._last_log_point():",
         "tests/test_event_order.py::test_stop_mid_epoch_still_logs_validates_and_ends")
mutation("TensorBoard gets validation metrics", "saferun/loggers/__init__.py",
         "    def on_validation_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:\n"
         "        self._write(view.step, metrics)",
         "    def on_validation_end(self, view: TrainerView, metrics: Mapping[str, float]) -> None:\n"
         "        pass",
         "tests/test_logging.py::test_tensorboard_has_every_metric_at_log_steps_and_the_config")

# ---------------------------------------------------------------- preemption
mutation("a signal sets the stop flag", "saferun/preemption.py",
         "        self.received = signum", "        pass",
         f"{RESUME}::test_a_signal_during_a_step_saves_right_after_that_step")
mutation("the stop is checked after every step", T,
         "        if self._strategy.agreement.stop_agreed(self._stop_signals):\n",
         "        if self._strategy.agreement.stop_agreed(self._stop_signals) and "
         "self.state.step % self.cfg.trainer.log_every_n_steps == 0:\n",
         f"{RESUME}::test_a_signal_during_a_step_saves_right_after_that_step")
mutation("the stop is checked between validation batches", EVAL,
         "                if stopped():\n", "                if False:\n",
         f"{RESUME}::test_a_signal_during_validation_stops_it_before_the_next_batch")
mutation("exit status 128 + the signal number", "saferun/preemption.py",
         "        super().__init__(128 + signum)", "        super().__init__(1)",
         f"{RESUME}::test_a_signal_during_a_step_saves_right_after_that_step")
mutation("a second Ctrl-C aborts at once", "saferun/preemption.py",
         "        elif signum == signal.SIGINT:\n            self._abort()",
         "        elif False:\n            self._abort()",
         f"{RESUME}::test_second_sigint_aborts_at_once")
MISTAKES = "tests/guards/test_mistakes.py"
EXPLAIN = "saferun/diagnose/explain.py"
DATA = "saferun/guards/datachecks.py"
mutation("errors in user code are explained", T,
         "or self._explain_failure(exc)\n", "or None\n", MISTAKES)
mutation("the explanation's replay finds the module", EXPLAIN,
         "    if last_failed:\n", "    if False:\n", MISTAKES)
mutation("the explanation's replay restores buffers and gradients", EXPLAIN,
         "            for b, saved in buffers:\n                b.copy_(saved)", "            pass",
         f"{MISTAKES}::test_the_replay_that_finds_the_module_leaves_buffers_rng_and_grads_as_the_failure_left_them")
mutation("an in-place autograd error is replayed under anomaly mode", EXPLAIN,
         "    trace = _forward_trace([str(w.message) for w in caught])\n", "    trace = None\n",
         MISTAKES)
mutation("a NaN already in the input is named before any layer", "saferun/guards/batchinfo.py",
         "    if not bad:\n        return \"\"", "    if True:\n        return \"\"", MISTAKES)
mutation("setup warns of a BatchNorm's last batch of one", DATA,
         "    if n % size != 1:\n", "    if True:\n", MISTAKES)
mutation("setup warns of a module frozen by hand", DATA, "        if moving:\n",
         "        if False:\n", MISTAKES)
mutation("check: train/validation overlap", DATA, "    if hits:\n", "    if False:\n", MISTAKES)
mutation("check: loss at initialisation", DATA, "    if loss > 2.0 * ln_c + 1.0:\n",
         "    if False:\n", MISTAKES)
mutation("check: batch independence", DATA, "    if others:\n", "    if False:\n", MISTAKES,
         "tests/guards/test_real_models.py::test_batchnorm_without_running_stats_is_by_design")
mutation("check: input-independent baseline", DATA,
         "    if math.isclose(real, zeroed, rel_tol=1e-6, abs_tol=1e-12):", "    if False:", MISTAKES)
mutation("a misspelt config key gets the closest valid one", "saferun/suggest.py",
         "            return f\" Did you mean {ends[found[0]]}?\"", "            return \"\"",
         "tests/unit/test_suggest.py")


# ---------------------------------------------------------------- saferun.testing (issue 14)

TESTING = "tests/testing/test_helpers.py"
mutation("worker seeding compares several draws per worker", "saferun/check.py",
         "Subset(dataset, [0] * (2 * DRAWS))", "Subset(dataset, [0] * 2)",
         f"{TESTING}::test_determinism_and_worker_seeding")
mutation("exact resume compares every tensor bitwise", "saferun/testing/resume.py",
         "return [] if _same_tensor(got, want) else", "return [] if True else",
         f"{TESTING}::test_exact_resume_passes_at_each_named_stop_and_names_what_differs")
mutation("golden losses fail on a drift", "saferun/testing/golden.py",
         "    if bad:\n        fail(_diff(", "    if False:\n        fail(_diff(",
         f"{TESTING}::test_golden_losses_write_compare_and_show_the_drift")
mutation("host syncs in training_step fail the test", "saferun/testing/checks.py",
         "    if any(kept):", "    if False:",
         f"{TESTING}::test_host_syncs_are_named_with_their_line")
mutation("a command line refused before the job imports no torch", "saferun/cli/run.py",
         "    import hydra\n\n    global _ARGS",
         "    import hydra\n\n    from ..distributed import ranks_from_env  # noqa: F401\n    global _ARGS",
         "tests/cli/test_first_hour.py::test_a_command_line_refused_before_the_job_never_imports_torch")
mutation("the run directory's checks import no torch", "saferun/checkpoint/rundir.py",
         "from ..errors import SaferunError\n", "from .. import distributed  # noqa: F401\nfrom ..errors import SaferunError\n",
         "tests/cli/test_first_hour.py::test_a_command_line_refused_before_the_job_never_imports_torch")
mutation("the pytest plugin imports nothing heavy", "saferun/pytest_plugin.py",
         "from .testing import options  #", "from .testing import options, jobs  #",
         "tests/testing/test_plugin.py::"
         "test_the_plugin_imports_nothing_heavy_in_a_project_that_does_not_use_it")
mutation("saferun new writes the project's tests", "saferun/cli/recipes.py",
         "    return written + write_project_tests(dest, name, recipe)", "    return written",
         "tests/testing/test_new_project.py::test_a_new_project_ships_tests_that_pass_as_generated")

# ---------------------------------------------------------------- metrics, EMA, loggers (issue 13)
AVG, LOGGERS = "saferun/loop/averaging.py", "saferun/loggers/__init__.py"
mutation("stateful metrics are reset before each validation", EVAL,
         "        reset_all(self._metrics)\n", "",
         "tests/loop/test_stateful_metrics.py::test_config_metrics_equal_sklearn_over_the_whole_set_at_each_validation")
mutation("the weight average skips skipped steps and copies integer buffers", AVG,
         "        self._ema_copied, self._raw_copied = [e for e, _ in copied], [r for _, r in copied]\n"
         "        self.hook = optimizer.register_step_post_hook(self._update)\n",
         "        self._ema_copied, self._raw_copied = [e for e, _ in copied], [r for _, r in copied]\n"
         "        self.averaged.multi_avg_fn = self._avg  # swa_utils' own update, as is\n"
         "        self.hook = optimizer.register_step_post_hook(\n"
         "            lambda *_: self.averaged.update_parameters(model))\n",
         "tests/loop/test_averaging.py::test_the_average_is_the_ema_of_the_weights_after_each_step_that_ran")
mutation("the weight average is resumed from the checkpoint", FORMATS,
         '        optimizer.load_state_dict(state["optimizer"])\n        if ema is not None:\n'
         '            ema.load_state_dict(state.get("ema"))\n',
         '        optimizer.load_state_dict(state["optimizer"])\n        if ema is not None:\n'
         '            ema.load_state_dict(None)\n',
         f"{RESUME}::test_sigkill_mid_epoch_then_resume_gives_bitwise_identical_weights")
mutation("under torchrun the ranks agree on the logged keys", "saferun/loop/metrics.py",
         "            keys = distributed.union(keys, data.group)\n", "            pass\n",
         "tests/parallel/test_rank_guarantees.py::test_logged_metrics_are_averaged_over_ranks")
mutation("a resumed TensorBoard file sorts after the earlier ones", LOGGERS,
         "        if earlier and mine and min(mine) < max(earlier):\n",
         "        if False:\n",
         f"{RESUME}::test_a_resumed_writer_whose_file_would_sort_before_the_earlier_ones_shows_each_step_once")
mutation("a rollback hides later TensorBoard steps", LOGGERS,
         "        if self._writer is not None:  # a rollback mid-run: hide what came after the checkpoint\n",
         "        if False:\n",
         "tests/test_logging.py::test_a_rollback_leaves_each_step_once_in_tensorboard_and_metrics_jsonl")
mutation("a rollback cuts metrics.jsonl back", LOGGERS,
         "        if self._file is not None:  # a rollback mid-run: cut what came after the checkpoint\n",
         "        if False:\n",
         "tests/test_logging.py::test_a_rollback_leaves_each_step_once_in_tensorboard_and_metrics_jsonl")
mutation("the step rolled back to is not validated again", T,
         "        due = self.val_loader is not None and state.validated_at != state.step and (",
         "        due = self.val_loader is not None and (",
         "tests/test_logging.py::test_a_rollback_leaves_each_step_once_in_tensorboard_and_metrics_jsonl")
mutation("logger: {} means no loggers", LOGGERS,
         "    return {k: v for k, v in merged.items() if v is not None and (removed or k in given)}\n",
         "    return {k: v for k, v in merged.items() if v is not None}\n",
         "tests/test_logging.py::test_an_empty_logger_mapping_means_no_loggers_from_python_and_the_command_line")

mutation("several optimizers: a user's in-place op on an activation is not the ordering slip",
         "saferun/loop/manual_checks.py",
         '    if found is None or found.group(2) not in (None, "AsStrided"):',
         "    if found is None:",
         "tests/loop/test_optimize_errors.py::test_a_users_inplace_op_matching_a_parameters_shape_and_version_is_not_the_slip")
mutation("torchrun: a peer failure is one that torch raised", "saferun/diagnose/explain_ranks.py",
         "            and _raised_in_torch(exc))", "            )",
         "tests/parallel/test_explain_ranks.py::test_a_users_own_error_that_reads_like_a_peer_failure_is_the_users",
         known="its test is a slow torchrun launch (pytest -m slow); killed by hand when written")
mutation("a batch counted as 0 samples is refused", "saferun/data/transfer.py",
         "    if count is None or not count > 0:", "    if count is None:",
         "tests/loop/test_batch_sizes.py::test_a_batch_the_default_cannot_count_is_refused")
mutation("a UserDict batch is counted", "saferun/data/transfer.py",
         "    elif isinstance(batch, Mapping):", "    elif isinstance(batch, dict):",
         "tests/loop/test_batch_sizes.py::test_a_userdict_batch_or_one_with_a_0_dim_tensor_first_counts_as_a_dict_does")
mutation("a batch size of another whole-number type is counted as an int", "saferun/data/transfer.py",
         "    return whole if whole == n else None", "    return n if whole == n else None",
         "tests/loop/test_batch_sizes.py::test_a_whole_number_of_another_type_counts_as_that_int")
mutation("a batch size that is not a whole number is refused", "saferun/data/transfer.py",
         "    return whole if whole == n else None", "    return whole",
         "tests/loop/test_batch_sizes.py::test_a_count_that_is_not_a_whole_number_is_refused")
mutation("the one-micro-batch step counts the batch size as an int", "saferun/trainer.py",
         "            samples = samples_in(micro_batches[0]", "            samples_in(micro_batches[0]",
         "tests/loop/test_batch_sizes.py::test_a_whole_number_of_another_type_counts_as_that_int")
mutation("a 0-dim tensor is not a batch's count", "saferun/data/transfer.py",
         "        return batch.shape[0] if batch.dim() > 0 else -1", "        return batch.shape[0] if batch.dim() > 0 else 1",
         "tests/loop/test_batch_sizes.py::test_a_userdict_batch_or_one_with_a_0_dim_tensor_first_counts_as_a_dict_does")
mutation("an empty batch is refused as empty", "saferun/data/transfer.py",
         "                if count == 0 and empty else", "                if False else",
         "tests/loop/test_batch_sizes.py::test_an_empty_batch_is_refused_as_empty")
mutation("validate()/predict() with resume unset over checkpoints say what they evaluate",
         "saferun/checkpoint/superseded.py", "    if found:\n        log.warning", "    if False:\n        log.warning",
         "tests/checkpoint/test_fresh_start.py::test_evaluating_alone_over_a_runs_checkpoints_with_resume_unset_says_what_it_evaluates")
mutation("resume=fresh moves the earlier run's .hydra/ aside", "saferun/checkpoint/superseded.py",
         "if rundir.writes_hydra_dir(str(path))", "if False",
         "tests/cli/test_cli.py::test_resume_fresh_sets_the_earlier_run_and_its_text_log_aside_and_logger_jsonl_null_drops_one")
mutation("an explanation under accumulation names the micro-batch", "saferun/loop/steps.py",
         "            record(exc, micro_batch=(i, len(sizes)))", "            pass",
         "tests/guards/test_explain_paths.py::test_an_error_under_accumulation_names_the_micro_batch")
mutation("a value some micro-batches log is the mean over theirs", "saferun/loop/steps.py",
         "        if reported != all_shares:", "        if False:",
         "tests/loop/test_train_logs.py::test_a_value_some_micro_batches_report_is_their_samples_mean")
mutation("a value some steps log is logged, as their mean", "saferun/loop/metrics.py",
         "for d in self.logs if k in d] for k in keys}", "for d in self.logs] for k in keys}",
         "tests/loop/test_train_logs.py::test_a_value_some_steps_report_is_logged_as_their_mean")
mutation("a shared TensorBoard log_dir keeps the other run's HParams entry", "saferun/loggers/__init__.py",
         "            if os.path.basename(earlier) not in self._others:  # another run's entry stays",
         "            if True:",
         "tests/test_logging.py::test_a_shared_log_dir_keeps_the_other_runs_hparams_entry_and_says_so")
mutation("a fused optimizer's step the GradScaler dropped leaves the schedule", "saferun/schedules.py",
         "            if found is None or not found.item():", "            if True:",
         "tests/loop/test_precision.py::test_steps_the_grad_scaler_skips_do_not_advance_the_schedule")
mutation("a fused optimizer's step the GradScaler dropped leaves the average", "saferun/loop/averaging.py",
         "    if found is not None and found.item():\n        return\n", "",
         "tests/loop/test_averaging.py::test_a_step_the_grad_scaler_drops_does_not_move_the_average")

# ---------------------------------------------------------------- branch audits: the user's model, loss, data (issue 24)
AUDITS = "tests/guards/test_audits.py"
MA, LA = "saferun/guards/model_audit.py", "saferun/guards/loss_audit.py"
mutation("audit: modules in plain containers are refused once a gradient reaches them", MA,
         "            if p.grad is not None]", "            if False]",
         f"{AUDITS}::test_modules_in_a_plain_list_are_refused_before_a_second_update")
mutation("audit: trainable modules in plain containers are warned about at setup", MA,
         "            if any(p.requires_grad for p in params):", "            if False:",
         f"{AUDITS}::test_modules_in_a_plain_dict_are_named_with_module_dict")
mutation("audit: a frozen module kept out of the model is left alone", MA,
         "            if any(p.requires_grad for p in params):", "            if True:",
         f"{AUDITS}::test_a_frozen_module_kept_out_of_the_model_on_purpose_is_left_alone")
mutation("audit: parameters made after the optimizer are refused", MA,
         "        if self.check_new_params:", "        if False:",
         f"{AUDITS}::test_a_layer_created_in_forward_is_named")
mutation("audit: the second-backward error names the carrier (audit off)", EXPLAIN,
         "    carriers = graph_carriers(model) if _SECOND_BACKWARD in message else []  # before a replay",
         "    carriers = []",
         f"{AUDITS}::test_with_the_audit_off_torchs_second_backward_error_is_explained_by_name")
mutation("audit: the second-backward error is left to the explanation that names the carrier",
         "saferun/loop/steps.py",
         "        if graph_carriers(model):  # diagnose/explain.py names", "        if False:  #",
         f"{AUDITS}::test_with_the_audit_off_torchs_second_backward_error_is_explained_by_name")
mutation("audit: plain tensor state that training changes is warned about", MA,
         "        if not changed:\n            return []", "        if True:\n            return []",
         f"{AUDITS}::test_state_in_a_plain_tensor_is_warned_about_with_register_buffer")
mutation("audit: the audits run (guards.model_audit)", T,
         "        self._frame.first_steps(*first, *audits)", "        self._frame.first_steps(*first)",
         f"{AUDITS}::test_modules_in_a_plain_list_are_refused_before_a_second_update",
         f"{AUDITS}::test_class_indices_out_of_range_name_the_positions_and_c")
mutation("audit: nothing runs after the second training_step call", MA,
         "        self.done = True\n        self._audit.after_first_backward",
         "        self._audit.after_first_backward",
         f"{AUDITS}::test_the_audits_run_in_the_first_two_steps_only")
mutation("audit: regression losses that broadcast the input are refused", LA,
         "    if shape == x.shape:\n        return None", "    if True:\n        return None",
         f"{AUDITS}::test_regression_losses_that_broadcast_are_refused_naming_both_shapes")
mutation("audit: a broadcast target is not refused", LA,
         "    if shape == x.shape:\n        return None", "    if False:\n        return None",
         f"{AUDITS}::test_matching_shapes_and_a_broadcast_target_are_not_reported")
mutation("audit: class indices outside [0, C) are refused", LA,
         "    bad = ((y < 0) | (y >= classes)) & (y != ignore)", "    bad = (y < 0) & (y != ignore)",
         f"{AUDITS}::test_class_indices_out_of_range_name_the_positions_and_c")
mutation("audit: probabilities into cross_entropy/nll_loss are refused", LA,
         "    if _row_sums_one(x):\n        if name", "    if False:\n        if name",
         f"{AUDITS}::test_probabilities_and_log_probabilities_where_each_is_expected")
mutation("audit: raw scores into nll_loss are warned about", LA,
         '    if name == "nll_loss" and not _log_normalised(x):', "    if False:",
         f"{AUDITS}::test_probabilities_and_log_probabilities_where_each_is_expected")
mutation("audit: a sigmoid's output into the logits loss is warned about", LA,
         "                ) if _made_by_sigmoid(x.grad_fn) else None", "                ) if False else None",
         f"{AUDITS}::test_a_sigmoid_before_the_logits_loss_is_said_once_per_line")
mutation("audit: a sigmoid's output is seen through shape-only ops", LA,
         "        if kind not in _SHAPE_ONLY:", "        if True:", f"{AUDITS}::test_a_sigmoid_before_the_logits_loss_is_said_once_per_line")
mutation("audit: with autograd, the graph decides whether a sigmoid made the logits", LA,
         "    if x.grad_fn is not None:\n", "    if False:\n", f"{AUDITS}::test_raw_scores_that_happen_to_lie_in_0_1_are_not_taken_for_a_sigmoids")
mutation("audit: without autograd, raw scores near 0 are not a sigmoid's", LA,
         "            and 0.2 < float(x.float().median()) < 0.8:", "            and True:", f"{AUDITS}::test_raw_scores_that_happen_to_lie_in_0_1_are_not_taken_for_a_sigmoids")
mutation("audit: a loss line's warning is said once", LA,
         "        if message in self.warnings:", "        if False:", f"{AUDITS}::test_a_sigmoid_before_the_logits_loss_is_said_once_per_line")
mutation("audit: the user's loss line is named", LA,
         "        if not file.startswith((_TORCH_DIR, _SAFERUN_DIR)):", "        if True:",
         f"{AUDITS}::test_regression_losses_that_broadcast_are_refused_naming_both_shapes")
mutation("audit: an unshuffled map-style training loader is warned about", DATA,
         "    if type(getattr(batches, \"sampler\", None)) is not SequentialSampler:",
         "    if True:", f"{MISTAKES}::test_planted_mistake_is_caught_with_its_culprit")
mutation("audit: trainer.shuffle=false marks the order as intended", DATA,
         "    if not shuffle or loader is None", "    if loader is None",
         f"{AUDITS}::test_the_order_warning_goes_when_trainer_shuffle_says_it_is_intended")
mutation("audit: eval determinism names the module", DATA,
         "        if not _all_equal(out, out2):", "        if False:",
         f"{MISTAKES}::test_planted_mistake_is_caught_with_its_culprit")
mutation("audit: eval determinism reads the sample twice", "saferun/check.py",
         "            if not all(_same(data[0], data[0]) for _ in range(3)):", "            if False:",
         f"{MISTAKES}::test_planted_mistake_is_caught_with_its_culprit")
mutation("audit: single-class batches are warned about", DATA,
         "    if 4 * len(single) >= 3 * len(per_batch) and len(set(single)) > 1:", "    if False:",
         f"{MISTAKES}::test_planted_mistake_is_caught_with_its_culprit")
# ---------------------------------------------------------------- sweeps and clusters (branch sweeps)
mutation("a sweep job ranks by its last validation, not its best during the run",
         "saferun/sweep/objective.py",
         "            if best is None or objective.better(value, best[0]):", "            if True:",
         "tests/sweeps/test_summary.py")
mutation("a NaN first validation stays a run's best", "saferun/sweep/objective.py",
         "        if math.isnan(b):\n            return True\n", "",
         "tests/sweeps/test_summary.py::test_best_during_run_reads_the_validations_not_the_train_lines_and_skips_nan")
mutation("sweep.metric without sweep.mode gets a guessed direction", "saferun/direction.py",
         "    if inferred is None:\n        raise ConfigError(", "    if False:\n        raise ConfigError(",
         "tests/sweeps/test_summary.py::test_the_objective_is_sweep_metric_else_save_best_else_val_loss")
mutation("the sweep summary ranks a maximized objective upside down", "saferun/sweep/summary.py",
         'o["value"] if o["mode"] == "min" else -o["value"]', 'o["value"]',
         "tests/sweeps/test_summary.py::test_the_summary_ranks_jobs_by_their_best_marks_the_best_and_lists_failed_jobs")
mutation("a SLURM job's processes meet at its last host", "saferun/sweep/cluster.py",
         "job.hostnames[0]", "job.hostnames[-1]", "tests/sweeps/test_cluster_env.py")
mutation("a requeued SLURM job meets on a new port", "saferun/sweep/cluster.py",
         "str(20000 + zlib.crc32(job.job_id.encode()) % 20000)",
         "str(__import__('random').randint(20000, 39999))", "tests/sweeps/test_cluster_env.py")
mutation("a sweeper or launcher without its package fails inside Hydra", "saferun/sweep/cluster.py",
         "if arg.startswith(choice) and importlib.util.find_spec(module) is None:", "if False:",
         "tests/sweeps/test_cluster_env.py")
mutation("a signal added to trainer.stop_signals is not listened to", "saferun/preemption.py",
         ", *(signal.Signals[name] for name in extra)", "",
         "tests/sweeps/test_stop_signals.py")
mutation("trainer.stop_signals accepts any name", "saferun/config.py",
         'if unknown or not {"SIGTERM", "SIGINT"} <= set(self.stop_signals):', "if False:",
         "tests/sweeps/test_stop_signals.py")
mutation("hydra/sweeper=... is refused as an unknown config key", "saferun/suggest.py",
         'if parts[0].split("/")[0] == "hydra":', 'if parts[0] == "hydra":',
         "tests/sweeps/test_cluster_env.py::test_hydras_sweeper_and_launcher_choices_pass_saferuns_key_check")
mutation("a submitit job stopped by the preemption signal is not requeued", "saferun/sweep/cluster.py",
         "            handler(stop.signum, None)", "            pass",
         "tests/sweeps/test_submitit.py::test_preempted_jobs_are_requeued_and_end_as_the_uninterrupted_one",
         known="its test is slow (pytest -m slow); killed by hand when written")
mutation("a requeued submitit job starts over instead of resuming", "saferun/sweep/cluster.py",
         '            cfg.resume = "auto"', "            pass",
         "tests/sweeps/test_submitit.py::test_preempted_jobs_are_requeued_and_end_as_the_uninterrupted_one",
         known="its test is slow (pytest -m slow); killed by hand when written")
mutation("a trial an interruption left running is not continued", "saferun/sweep/study.py",
         "    for frozen in reclaimed:", "    for frozen in ():",
         "tests/sweeps/test_optuna.py::test_an_interrupted_study_continues_its_trials_and_resumes_the_interrupted_one",
         known="its test is slow (pytest -m slow); killed by hand when written")
# ---- resume-course (issue 21: items 1, 2, 11b, 11c, 14)
mutation("a resume that changes what validation sees is refused", "saferun/checkpoint/compat.py",
         '                  "trainer.val_every_n_steps", "trainer.limit_val_batches",\n'
         '                  "trainer.val_batch_size")', ")",
         "tests/checkpoint/test_resume.py::test_a_resume_that_changes_what_validation_sees_is_refused_without_force_resume")
mutation("resume=latest (or True) asks: did you mean resume=auto", CKPTR,
         "        if resume.lower() in _AUTO_WORDS:", "        if False:",
         "tests/checkpoint/test_resume.py::test_a_resume_that_finds_no_checkpoint_says_what_is_there_and_what_resume_accepts")
mutation("resume=<a folder of runs> names its latest run directory", CKPTR,
         "        if runs:\n            what +=", "        if False:\n            what +=",
         "tests/checkpoint/test_resume.py::test_a_resume_that_finds_no_checkpoint_says_what_is_there_and_what_resume_accepts")
COURSE, TCOURSE = "saferun/checkpoint/course.py", "tests/checkpoint/test_course.py"
STOPPED = TCOURSE + "::test_a_change_of_course_stopped_between_two_renames_is_finished_by_resume_auto"
TWICE = TCOURSE + "::test_carrying_out_a_change_twice_moves_each_entry_once"
OTHER_DIR = TCOURSE + "::test_another_run_directorys_checkpoint_sets_this_ones_earlier_run_aside_and_continues_paths_logs"
BEST_AFTER = TCOURSE + "::test_after_a_change_of_course_save_best_names_a_checkpoint_of_this_run_directory_or_none"
mutation("a change of course is recorded before anything moves", COURSE,
         "                _write_record(Path(run_dir), record)\n", "", STOPPED)
mutation("resume=auto resumes from an unfinished change's checkpoint", CKPTR,
         "        if unfinished is not None:  # a change of course a killed run left", "        if False:  #", STOPPED)
mutation("resume=auto carries an unfinished change of course out", CKPTR,
         "            if o.cfg.resume != \"auto\" or course.interrupted(o.state.run_dir) or",
         "            if o.cfg.resume != \"auto\" or", STOPPED)
mutation("a start other than the unfinished change's own is refused", CKPTR,
         "            if unfinished is not None and (found is None or", "            if False and (found is None or", STOPPED)
mutation("each entry of a change of course moves once", COURSE,
         "        if os.path.lexists(source) and not os.path.lexists(target):", "        if os.path.lexists(source):", TWICE)
mutation("the continued course's TensorBoard events are copied once", COURSE,
         "    if not source.is_dir() or os.path.lexists(target):", "    if not source.is_dir():", TWICE)
mutation("the continued course's metrics.jsonl holds PATH's course's lines up to PATH", COURSE,
         "json.loads(line)[\"step\"] > step:", "json.loads(line)[\"step\"] > step + 100:", TWICE)
mutation("the continued course gets PATH's course's metrics.jsonl", COURSE,
         "        _copy_jsonl(past / \"metrics.jsonl\"", "        (past / \"metrics.jsonl\"", OTHER_DIR)
mutation("the continued course's TensorBoard events are PATH's up to PATH", COURSE,
         "                    if Event.FromString(record).step <= step:", "                    if True:", TWICE)
mutation("the superseded course's HParams entry is not copied", COURSE,
         "            if file.name.endswith(\".hparams\"):", "            if False:", TWICE)
mutation("resume=PATH elsewhere saves this run directory's own first checkpoint", CKPTR,
         "            self.ensure_one(save)\n            course.finished(", "            course.finished(", OTHER_DIR)
mutation("a finished change of course removes its record", CKPTR,
         "            course.finished(o.state.run_dir, changed, o.ranks.is_main)\n", "", STOPPED)
mutation("a killed pass's temporary copies are removed", COURSE,
         "            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()", "            pass", TWICE)
mutation("save_best's record after a change of course is this directory's or none", CKPTR,
         "            self._best_of_this_directory(path)\n", "            pass\n", BEST_AFTER)
mutation("save_best's record naming PATH names this directory's copy", CKPTR,
         "            self.best = dataclasses.replace(self.best, checkpoint=str(root / resumed.name))",
         "            pass", BEST_AFTER)
# ---------------------------------------------------------------- guard-cost (issue 27)
SPIKES_T = "tests/guards/test_spikes.py"
mutation("spikes never enter the window (refreshed statistics)", "saferun/guards/spikes.py",
         "        accept = v <= limit  # not a spike, and finite (NaN: not finite)",
         "        accept = ~v.isnan()",
         f"{SPIKES_T}::test_spikes_do_not_enter_the_window_so_a_second_one_is_flagged_too")
mutation("spikes: non-finite values are not spikes (per-step comparison)", "saferun/guards/spikes.py",
         "        v = torch.nan_to_num(v, nan=_NAN, posinf=_NAN, neginf=_NAN)\n",
         "",
         f"{SPIKES_T}::test_non_finite_values_are_neither_spikes_nor_kept")
mutation("spikes: non-finite values are not spikes (log-point comparison)", "saferun/guards/spikes.py",
         "        values = torch.nan_to_num(values, nan=_NAN, posinf=_NAN, neginf=_NAN)\n",
         "",
         f"{SPIKES_T}::test_update_many_flags_and_keeps_exactly_what_one_update_per_value_does")
mutation("spikes: statistics refreshed after warmup and while the window fills", "saferun/guards/spikes.py",
         "        self._due = 1 if self._updates < self.window else self.refresh_every",
         "        self._due = self.refresh_every",
         f"{SPIKES_T}::test_statistics_refresh_at_each_update_until_the_window_is_full_then_every_refresh_every",
         "tests/parallel/test_torchrun.py::test_a_spike_on_rank_1_is_reported_with_its_values_and_checkpointed_per_rank")
mutation("spikes: the limit and update count are saved with the state", "saferun/guards/spikes.py",
         '            self._updates, self._due = int(states[0]["updates"]), int(states[0]["due"])',
         "            self._updates, self._due = 0, self.warmup",
         f"{SPIKES_T}::test_state_saved_between_refreshes_resumes_with_identical_decisions")
mutation("spikes: several series load only a state that holds each of them", "saferun/guards/spikes.py",
         "        if missing:\n", "        if False:\n",
         f"{SPIKES_T}::test_several_series_refuse_values_and_states_that_do_not_fit")
mutation("spikes: several series load only states updated together", "saferun/guards/spikes.py",
         '        if kept and len({(int(one["updates"]), int(one["due"])) for one in states}) > 1:',
         "        if False:",
         f"{SPIKES_T}::test_several_series_refuse_values_and_states_that_do_not_fit")
mutation("spikes: values that are not one per series refused", "saferun/guards/spikes.py",
         "        if not good:\n", "        if False:\n",
         f"{SPIKES_T}::test_several_series_refuse_values_and_states_that_do_not_fit")
mutation("check_params: saves between log points check the parameters", BADSTEP,
         "        if g.check_params and first_nonfinite(tr.model.named_parameters()) is not None:",
         "        if False:",
         "tests/guards/test_guards.py::test_check_params_keeps_a_non_finite_parameter_out_of_every_checkpoint")
mutation("sync audit: only sampled steps are audited", "saferun/guards/sync_audit.py",
         "        if self._seen < self.first or step % self.every == 0:",
         "        if True:",
         "tests/guards/test_guards.py::test_sync_audit_audits_only_its_sampled_steps")

# ---------------------------------------------------------------- everyday-log (issue 23: self.log, trackers)
mutation("self.log's non-mean values since the last log point are checkpointed", "saferun/loop/metrics.py",
         '                "folded": self.folded.state_dict(), ', '                ',
         "tests/logging/test_log_resume.py::test_resumed_mid_window_logs_every_value_and_media_once_as_uninterrupted")
mutation("images logged since the last log point are checkpointed", "saferun/loop/metrics.py",
         '"media": [vars(m) for m in self.media]}', '}',
         "tests/logging/test_log_resume.py::test_resumed_mid_window_logs_every_value_and_media_once_as_uninterrupted")
mutation("TensorBoard writes the checkpoint step's media again after a resume's purge", "saferun/loggers/__init__.py",
         "            self.on_media(view, list(self._last_media))\n", "",
         "tests/logging/test_log_resume.py::test_resumed_mid_window_logs_every_value_and_media_once_as_uninterrupted")
mutation("a fresh TensorBoard writer starts a session, so the server applies a resume's purge",
         "saferun/loggers/__init__.py", "else None if self._others else 0)", "else None)",
         "tests/logging/test_log_resume.py::test_resumed_mid_window_logs_every_value_and_media_once_as_uninterrupted")
mutation("reduce=min keeps the smallest value", "saferun/loop/logbook.py",
         "        return torch.minimum(old, new)", "        return new",
         "tests/logging/test_log_reductions.py::test_each_reduction_logs_what_it_says_over_each_window")
mutation("reduce=last under torchrun is the latest step's, from the lowest rank", "saferun/loop/logbook.py",
         "(positions == positions.max()).int().argmax()", "(positions == positions.max()).int().argmin()",
         "tests/logging/test_evaluate_callbacks.py::test_every_reduction_is_agreed_over_two_real_ranks")
mutation("an on_evaluate callback runs on rank 0 unless it asks for all", "saferun/callbacks.py",
         "            if ranks == \"all\" or is_main:", "            if True:",
         "tests/logging/test_evaluate_callbacks.py::test_every_reduction_is_agreed_over_two_real_ranks")
mutation("a logged 'loss' other than the returned loss is refused", "saferun/loop/logbook.py",
         "        if both:\n            loss =", "        if False:\n            loss =",
         "tests/logging/test_log_reductions.py::test_mistakes_are_refused_with_what_to_do")
mutation("a name keeps one reduction", "saferun/loop/logbook.py",
         "        if self.reduces.setdefault(key, reduce) != reduce:", "        if False:",
         "tests/logging/test_log_reductions.py::test_mistakes_are_refused_with_what_to_do")
mutation("Lightning's self.log arguments are refused with what saferun does instead",
         "saferun/loop/logbook.py", "        if extra:\n            said", "        if False:\n            said",
         "tests/logging/test_log_reductions.py::test_mistakes_are_refused_with_what_to_do")
mutation("an on_evaluate callback is checked by the purity guard", "saferun/loop/evaluation.py",
         "        before = fingerprint(self._model) if self._purity else None\n        # preserved_rng",
         "        before = None\n        # preserved_rng",
         "tests/logging/test_evaluate_callbacks.py::test_on_evaluate_that_changes_the_model_is_caught_by_the_purity_guard")
mutation("MLflow: the steps a resumed run's store holds are not sent again", "saferun/loggers/trackers.py",
         "               if step > self._held.get(k, -1)]", "               if True]",
         "tests/logging/test_trackers.py::test_mlflow_store_holds_params_metrics_media_and_artifacts_and_a_resume_continues_the_run")
mutation("MLflow: a new course's run is linked to the checkpoint's run", "saferun/loggers/trackers.py",
         '        return {"run_id": self.run_id, "sent": self._sent}', '        return {"sent": self._sent}',
         "tests/logging/test_tracker_lifecycle.py::test_mlflow_a_change_of_course_gets_a_new_linked_run_and_the_old_run_keeps_its_course")
mutation("W&B: the steps an interrupted run sent are not sent again", "saferun/loggers/trackers.py",
         "        if step <= self._held:\n", "        if False:\n",
         "tests/logging/test_trackers.py::test_wandb_offline_writes_locally_and_a_resume_continues_the_same_run",
         known="its test is slow (W&B's service, twice): run by hand with -m slow")
mutation("on_evaluate may not log a name validation_step reports", "saferun/loop/logbook.py",
         "        if name in self._book.val_names:", "        if False:",
         "tests/logging/test_evaluate_callbacks.py::test_on_evaluate_logging_a_name_validation_step_reports_is_refused")
mutation("self.step is 1-based inside training_step", "saferun/trainer.py",
         '        return self.state.step + (self._logbook.phase == "train")', "        return self.state.step",
         "tests/logging/test_log_resume.py::test_step_and_epoch_in_every_hook_match_the_logged_steps")
# cli-messages: command-line and check messages (issue 21, items 5, 6, 7, 12, 13, 15, 17, 18)
mutation("no key suggestion when none is close", "saferun/suggest.py",
         "get_close_matches(last, list(ends), n=1, cutoff=0.8)", "get_close_matches(last, list(ends), n=1, cutoff=0.4)",
         "tests/unit/test_suggest.py::test_a_suggestion_matches_the_keys_last_part_or_there_is_none")
mutation("a string where the target takes a number is refused naming the key", "saferun/config.py",
         "    default = None if param is None else param.default\n", "    return\n    default = None\n",
         "tests/unit/test_config.py::test_a_string_where_the_target_takes_a_number_names_the_key")
mutation("an input baseline that cannot conclude says inconclusive", "saferun/guards/datachecks.py",
         "    if not real < 0.99 * zeroed:  # the output depends on the inputs", "    if False:  #",
         "tests/guards/test_check.py::test_an_input_baseline_that_cannot_conclude_says_so_instead_of_blaming_the_inputs")
mutation("a one-batch overfit that falls slowly is inconclusive", "saferun/check.py",
         "    if losses[-1] < losses[0] and not losses[-1] < 0.9 * losses[0]:  # falling, slowly", "    if False:",
         "tests/testing/test_new_project.py::test_a_harmless_edit_passes_the_generated_check_test",
         known="its test is a slow generated-project check (pytest -m slow); killed by hand when written")
mutation("lazy modules are materialised before the eval-purity check", "saferun/check.py",
         "    _first_forward(trainer, cfg.seed)\n", "",
         "tests/guards/test_check.py::test_lazy_modules_are_no_eval_purity_false_alarm")
mutation("each check's Trainer has its own directory", "saferun/check.py",
         "_run(check, _in_own_dir(make, tmp), base)", "_run(check, make, base)",
         "tests/guards/test_check.py::test_every_shipped_recipe_passes_every_check")
mutation("resume=auto in a run directory made for this run is refused", "saferun/cli/rundirs.py",
         '    if resume == "auto" and made is not None:', "    if False:",
         "tests/cli/test_cli.py::test_resume_auto_in_a_run_directory_made_for_this_run_is_refused_naming_the_latest_runs")
mutation("trainer.run_dir on the command line is refused", "saferun/cli/rundirs.py",
         "    if configured is not None:", "    if False:",
         "tests/cli/test_cli.py::test_bad_input_exits_non_zero_naming_the_key[trainer.run_dir=mine-words12]")
mutation("a refused command-line run leaves nothing behind", "saferun/cli/run.py",
         "            rundirs.remove_if_refused(run_dir)", "            pass",
         "tests/cli/test_cli.py::test_bad_input_exits_non_zero_naming_the_key[optim.lr=-0.1-words4]")
mutation("a preflight warning found on both loaders is logged once", "saferun/guards/preflight.py",
         "                if warning not in said:", "                if True:",
         "tests/guards/test_guards.py::test_a_generator_object_on_the_dataset_is_reported_once")
mutation("the default run directory is new for each Trainer", "saferun/checkpoint/rundir.py",
         'f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"', 'f"{datetime.datetime.now():%Y%m%d-%H%M%S}"',
         "tests/checkpoint/test_default_run_dir.py::test_fits_started_within_a_second_get_their_own_directories")
mutation("a save broken by a dead rank says so, not the disk", "saferun/checkpoint/store.py",
         "    if peer is not None:  # not the disk", "    if False:  # not the disk",
         "tests/parallel/test_save_peer.py::test_a_rank_killed_during_a_save_is_reported_as_a_dead_rank",
         known="its test is a slow FSDP torchrun launch (pytest -m slow); killed by hand when written")
mutation("a rank stopped by another's failure raises its explanation", "saferun/diagnose/explain.py",
         "            if said is None:\n                return None", "            if True:\n                return None",
         "tests/parallel/test_explain_ranks.py::test_a_mistake_on_rank_1_under_ddp_is_explained_there_and_named_by_rank_0")
# ---------------------------------------------------------------- branch loop-edges
mutation("a second fit() with nothing left to train is refused", "saferun/trainer.py",
         "        if self._fitted is not None and (done or self._fitted == (t.max_steps, t.max_epochs)):",
         "        if False:",
         "tests/loop/test_loop_edges.py::test_a_second_fit_with_nothing_left_is_refused_saying_how_to_continue")
mutation("a second fit() continues mid-epoch as a resume would", "saferun/loop/batches.py",
         "            self.resume(get_rng_state(), self.epoch_start)", "            pass",
         "tests/loop/test_loop_edges.py::test_a_second_fit_continues_to_a_raised_limit_exactly_as_one_longer_run")
mutation("max_epochs alone is not capped by the default max_steps", "saferun/config.py",
         "        if self.max_steps is None and self.max_epochs is None:",
         "        if self.max_steps is None:",
         "tests/loop/test_loop_edges.py::test_max_epochs_alone_is_not_capped_by_the_default_max_steps",
         "tests/loop/test_loop_edges.py::test_the_step_default_applies_only_without_max_epochs_and_both_set_are_kept")
mutation("max_steps ending the run before max_epochs is said at the start", "saferun/trainer.py",
         "                and self._fitted is None and self.ranks.is_main):",
         "                and False):",
         "tests/loop/test_loop_edges.py::test_both_set_the_first_limit_ends_the_run_and_setup_says_which")
mutation("a module left in train mode by validation_step is refused", "saferun/loop/evaluation.py",
         "            self._modes.check(step, hook, modes_seen)", "            pass",
         "tests/loop/test_loop_edges.py::test_a_mode_changed_in_validation_step_is_refused_naming_module_and_hook")
mutation("a module left in train mode by predict_step is refused", "saferun/loop/evaluation.py",
         "            self._modes.check(step, \"predict_step\", modes_seen)", "            pass",
         "tests/loop/test_loop_edges.py::test_a_mode_changed_in_predict_step_is_refused_naming_module_and_hook")
mutation("a step hook taking more than the batch is refused at setup", "saferun/loop/habits.py",
         "        if len(required) <= 1 and takes_one:\n            continue",
         "        continue",
         "tests/loop/test_loop_edges.py::test_a_step_hook_taking_a_batch_index_is_refused_at_setup")
mutation("an optimizer.step() inside training_step is refused before the update",
         "saferun/loop/habits.py", "        if self.step and not self.saferun_steps:\n            raise SaferunError(_loop_job(self.step, f\"{type(optimizer)", "        if False:\n            raise SaferunError(_loop_job(self.step, f\"{type(optimizer)",
         "tests/loop/test_loop_edges.py::test_a_backward_or_optimizer_step_inside_training_step_is_refused_before_any_update")
mutation("self.optimize()'s own optimizer steps are not refused", MANUAL,
         "            self._habits.saferun_steps = True  # inside training_step: this update's step,\n",
         "",
         "tests/loop/test_optimizers.py::test_each_update_equals_a_hand_written_loop_bitwise")
mutation("a backward inside training_step is refused at the first step", "saferun/loop/habits.py",
         "        if had_grads or not any(p.grad is not None for p in params):",
         "        if True:",
         "tests/loop/test_loop_edges.py::test_a_backward_or_optimizer_step_inside_training_step_is_refused_before_any_update")
mutation("autograd's second-backward error is explained", "saferun/loop/steps.py",
         "    if type(exc) is RuntimeError and \"backward through the graph a second time\" in str(exc):",
         "    if False:",
         "tests/loop/test_loop_edges.py::test_a_later_backward_inside_training_step_gets_autograd_error_explained")
mutation("a stream's end ends the epoch (validation)", "saferun/loop/batches.py",
         "                yield [], True, None  # (the loop validates, saves or stops as at an epoch's end)\n",
         "                pass\n",
         "tests/loop/test_loop_edges.py::test_a_stream_ends_each_epoch_like_map_style_data",
         "tests/loop/test_loop_edges.py::test_a_stream_resumes_at_and_across_an_epoch_end_exactly")
mutation("force_resume replays each schedule by its own step count", "saferun/schedules.py",
         "        for _ in range((saved or {}).get(\"last_epoch\", steps)):",
         "        for _ in range(steps):",
         "tests/loop/test_optimizers.py::test_force_resume_replays_each_schedule_by_its_own_steps")
mutation("force_resume refuses a ReduceLROnPlateau among several optimizers", "saferun/schedules.py",
         "        return {name: _configured(opt, (scheduler or {}).get(name), f\" (optimizer {name!r})\")",
         "        return {name: _configured(opt, None, f\" (optimizer {name!r})\")",
         "tests/loop/test_optimizers.py::test_force_resume_with_a_plateau_among_several_is_refused_naming_it")
mutation("limit_val_batches means the same samples on any number of processes", "saferun/data/__init__.py",
         "        sampler = ShardSampler(n if limit is None else min(n, limit), rank, world_size)",
         "        sampler = ShardSampler(n, rank, world_size)",
         "tests/parallel/test_ddp_paths.py::test_limit_val_batches_means_the_same_samples_on_two_processes_as_on_one")
mutation("limit_val_batches over a loader saferun cannot cut is refused under torchrun", "saferun/data/__init__.py",
         "    if isinstance(sampler, ShardSampler) and sampler.indices.stop <= samples:",
         "    if True:",
         "tests/parallel/test_ddp_paths.py::test_limit_val_batches_over_a_loader_saferun_cannot_cut_is_refused")

# The failure site: the loop's call sites tell the explanation the phase, the batch, the
# micro-batch and the optimize() call (no traceback walking).
mutation("failure site: a training step's error is explained (one optimizer)", "saferun/trainer.py",
         '            record(exc, phase="training", batch=batch)', '            pass',
         "tests/guards/test_mistakes.py::test_any_exception_keeps_its_type_and_a_users_own_class_is_left_as_raised")
mutation("failure site: validation and predict errors are explained", "saferun/loop/evaluation.py",
         "        record(exc, phase=phase, batch=batch)", "        pass",
         "tests/guards/test_explain_paths.py::test_validate_and_predict_alone_explain_their_steps")
mutation("failure site: an optimizer's failing step is named", "saferun/loop/update.py",
         '                record(exc, optimize_part="step")\n                raise\n        release_grads',
         '                raise\n        release_grads',
         f"{ERRS}::test_an_error_in_an_optimizers_step_names_the_call_and_the_step")
mutation("failure site: a failing backward in optimize() is named", MANUAL,
         '                if slip is None:\n                    record(exc, optimize_part="backward")\n',
         '                if slip is None:\n',
         f"{ERRS}::test_an_error_in_an_optimize_calls_backward_names_the_optimizer_and_the_line")
mutation("failure site: an inner site's fields are kept", "saferun/loop/failure_site.py",
         "        if getattr(site, name) is None:", "        if True:",
         f"{ERRS}::test_an_error_in_an_optimize_calls_backward_names_the_optimizer_and_the_line")

# Correct code that keeps forward outputs on the module (a KL term, attention weights, a
# re-made weight) is neither refused nor warned about; a cache evaluation made is named.
mutation("audit: a kept graph is refused only if the next loss reaches it", MA,
         "        reached = _reached(output, carried) if carried else []",
         "        reached = list(carried)",
         f"{AUDITS}::test_outputs_kept_on_the_module_are_not_carried_graphs_nor_state")
mutation("audit: a carried graph the next loss reaches is refused", MA,
         "        if reached:\n            raise ModelStateError", "        if False:\n            raise ModelStateError",
         f"{AUDITS}::test_a_graph_carried_into_the_next_step_is_named_before_torch_fails")
mutation("audit: a forward's output kept on the module is not warned about as state", MA,
         "                   if name not in outputs and (", "                   if (",
         f"{AUDITS}::test_outputs_kept_on_the_module_are_not_carried_graphs_nor_state")
mutation("purity: a forward's output kept on the module is not refused", "saferun/guards/purity.py",
         "_nested(f\"{prefix}{key}\", value, 2) if p not in outputs]", "_nested(f\"{prefix}{key}\", value, 2)]",
         f"{AUDITS}::test_outputs_kept_on_the_module_are_not_carried_graphs_nor_state")
mutation("an inference tensor saved by training names the model's attribute", "saferun/loop/steps.py",
         '        named = f" The model holds: {\', \'.join(held[:3])}." if held else ""',
         '        named = ""',
         f"{AUDITS}::test_a_cache_made_in_evaluation_and_saved_by_training_is_explained_by_name")
mutation("audit: modules in nested containers and on plain objects are found", MA,
         "        if isinstance(value, (dict, list, tuple, set, frozenset)):\n            stack.extend",
         "        if False:\n            stack.extend",
         f"{AUDITS}::test_modules_in_nested_containers_and_on_plain_objects_are_refused")
mutation("audit: layers on a plain object are found", MA,
         "        elif _plain_object(value):", "        elif False:",
         f"{AUDITS}::test_modules_in_nested_containers_and_on_plain_objects_are_refused")
mutation("a model with every layer hidden is told where they are", "saferun/loop/steps.py",
         "        hidden = hidden_layers_advice(model)", "        hidden = \"\"",
         f"{AUDITS}::test_a_model_whose_layers_are_all_hidden_is_told_where_they_are")
mutation("a misspelt debug option is refused (debug is not an optional group)", "conf/config.yaml",
         "  - debug: null ", "  - optional debug: null ",
         "tests/unit/test_suggest.py::test_a_misspelt_group_option_is_refused_with_the_options",
         known="saferun.conf resolves to the checkout's conf/ through the editable install's package "
               "map, not to the copy's; killed by hand when written")
mutation("loss audit: the tolerance follows the dtype (bf16)", LA,
         "    return max(1e-3, 4 * eps * x.shape[dim] ** 0.5) if x.dim() else 1e-3", "    return 1e-3",
         f"{AUDITS}::test_bf16_log_probabilities_and_probabilities_are_told_apart_at_bf16_precision")
mutation("self.log: a reduction per phase (train/acc and val/acc)", "saferun/loop/logbook.py",
         "        key = (self.phase, name)", "        key = (None, name)",
         "tests/logging/test_log_reductions.py::test_one_name_in_training_and_validation_may_keep_a_reduction_each")
BESTM = "tests/checkpoint/test_best_model.py::"
STAGE = "tests/loop/test_test_stage.py::"
mutation("best: model_best.pt written at the validation that sets a new best",
         "saferun/checkpoint/checkpointer.py",
         """        if self.best is not None and self.best.checkpoint == str(path):
            self.write_weights("_best")""",
         """        pass""",
         BESTM + "test_model_best_holds_the_weights_of_the_best_validation")
mutation("best: the best record survives a resume", "saferun/checkpoint/checkpointer.py",
         """        self.best = self._best_record(state["loop"]["best"]) if self._same_best(state) else None""",
         """        self.best = None""",
         BESTM + "test_a_resumed_run_keeps_the_best_and_does_not_overwrite_model_best")
mutation("best: model_best.pt written again when resumed at the best's step",
         "saferun/checkpoint/checkpointer.py",
         """        if self.best is not None and self.best.step == o.state.step:""", """        if False:""",
         BESTM + "test_a_crash_between_the_best_checkpoint_and_model_best_is_repaired_on_resume")
mutation("best: from_run loads the named weights", "saferun/trainer.py",
         """            load_weights(self.model, weights.model, weights.source)""", """            pass""",
         BESTM + "test_from_run_best_loads_model_best_bitwise_and_never_writes_the_old_run")
mutation("best: from_run never writes into the old run directory", "saferun/trainer.py",
         """"run_dir": out_dir}""", """"run_dir": out_dir or run_dir}""",
         BESTM + "test_from_run_without_out_dir_gets_a_new_run_directory")
mutation("best: load_model returns the model in eval mode", "saferun/checkpoint/weights.py",
         """    return model.eval()""", """    return model""",
         BESTM + "test_load_model_rebuilds_the_model_node_with_the_weights_in_eval_mode")
mutation("best: weights that do not fit the model name the keys", "saferun/checkpoint/weights.py",
         """    if missing or unexpected or shapes:""", """    if False:""",
         BESTM + "test_weights_that_do_not_fit_name_the_keys")
mutation("best: EarlyStopping(restore_best) puts the best weights back", "saferun/checkpoint/checkpointer.py",
         """            self.restore_best()  # after model.pt""", """            pass  # after model.pt""",
         BESTM + "test_restore_best_puts_the_best_weights_back_and_keeps_the_files")
mutation("best: a fit() after restore_best is refused", "saferun/trainer.py",
         """        if self._checkpointer.restored_best:""", """        if False:""",
         BESTM + "test_restore_best_puts_the_best_weights_back_and_keeps_the_files")
mutation("best: restore_best needs save_best on its metric", "saferun/stopping.py",
         """        if self.restore_best:\n            self._check""", """        if False:\n            self._check""",
         BESTM + "test_restore_best_needs_save_best_on_the_same_metric")
mutation("test stage: test() evaluates the test data, not the validation set", "saferun/trainer.py",
         """self.val_loader if val else loader""", """self.val_loader""",
         STAGE + "test_test_equals_a_hand_written_eval_loop")
mutation("test stage: limit_val_batches does not cut the test set", "saferun/trainer.py",
         """self.cfg.trainer.limit_val_batches if val else None""", """self.cfg.trainer.limit_val_batches""",
         STAGE + "test_test_equals_a_hand_written_eval_loop")
mutation("test stage: test_step in eval mode under inference_mode", "saferun/loop/evaluation.py",
         """        stack.enter_context(modes.evaluating(self._model, self._grad_mode))""", "",
         STAGE + "test_test_step_runs_in_eval_mode_under_inference_mode")
mutation("test stage: test metrics in metrics.jsonl", "saferun/loggers/__init__.py",
         """            f.write(self._line("test", view, metrics))""", """            pass""",
         STAGE + "test_what_test_step_only_logs_is_reported_everywhere")
mutation("test stage: test metrics in summary.json", "saferun/trainer.py",
         """            update_summary(self.state.run_dir, {"test": metrics, "test_at_step": self.state.step,""",
         """            (lambda *_: None)(self.state.run_dir, {"test": metrics, "test_at_step": self.state.step,""",
         STAGE + "test_what_test_step_only_logs_is_reported_everywhere")
mutation("test stage: build_datasets' third set is the test set", "saferun/data/__init__.py",
         """sets[2] if len(sets) == 3 else None""", """None""",
         STAGE + "test_build_datasets_may_return_a_test_set")
mutation("test stage: the test set is split over the ranks", "saferun/data/__init__.py",
         """    return make_loader(dataset, batch_size=size, shuffle=False, drop_last=False,
                       evaluation=True, limit=limit, **common)""",
         """    return make_loader(dataset, batch_size=size, shuffle=False, drop_last=False,
                       evaluation=False, limit=limit, **common)""",
         "tests/parallel/test_test_ranks.py::test_test_under_torchrun_equals_one_process",
         known="its test is a slow torchrun launch (pytest -m slow); killed by hand when written")
BESTT = "tests/checkpoint/test_best_model.py::"
mutation("best: an evaluating trainer resumed from a run knows its best", "saferun/checkpoint/checkpointer.py",
         '        self.best = self._best_record(state["loop"]["best"])  # Trainer.best, before any fit',
         "        pass", BESTT + "test_an_evaluating_trainer_resumed_from_a_run_knows_its_best")
mutation("test stage: from_run's out_dir is not the run it reads", "saferun/checkpoint/weights.py",
         "    if where.resolve() == Path(run_dir).resolve():", "    if False:",
         BESTT + "test_test_never_writes_into_a_run_it_did_not_evaluate")
mutation("test stage: from_run's out_dir holds no other run", "saferun/checkpoint/weights.py",
         "    if held:\n", "    if False:\n", BESTT + "test_test_never_writes_into_a_run_it_did_not_evaluate")
mutation("test stage: test() over a run's checkpoints with resume unset is refused",
         "saferun/checkpoint/superseded.py", '    if found and entry == "test":', "    if False:",
         BESTT + "test_test_never_writes_into_a_run_it_did_not_evaluate")
mutation("best: a resume that changes save_best tracks the best anew", "saferun/checkpoint/checkpointer.py",
         "        if before == (t.save_best, self.best_mode):", "        if True:",
         BESTT + "test_a_resume_that_changes_save_best_tracks_the_best_anew")
mutation("failure site: an error in test_step is explained as test_step's", "saferun/loop/evaluation.py",
         'self._raise_explained(exc, hook.split("_")[0], batch)', 'self._raise_explained(exc, "validation", batch)',
         "tests/guards/test_explain_paths.py::test_validate_and_predict_alone_explain_their_steps")

mutation("distributed: the group saferun started is left before interpreter teardown",
         "saferun/distributed.py", "        atexit.register(_leave_group)\n", "",
         "tests/logging/test_evaluate_callbacks.py::test_every_reduction_is_agreed_over_two_real_ranks")


mutation("policies: a spike rollback keeps a checkpoint from the start", BADSTEP,
         "                                 or self.spike_policy.needs_checkpoint or g.anomaly_replay)",
         "                                 or g.anomaly_replay)",
         f"{GUARDS}::test_a_spike_rolls_back_to_a_checkpoint_made_for_it_before_the_first_save")
mutation("policies: a spike under rollback is rolled back", "saferun/guards/policies.py",
         "        return Verdict.ROLL_BACK", "        return Verdict.RAISE",
         f"{GUARDS}::test_a_spike_rolls_back_to_a_checkpoint_made_for_it_before_the_first_save")


mutation("several optimizers: a step with a skipped update restores the buffers", BADSTEP,
         "        assert self.snapshot is not None\n        self.snapshot.restore()\n",
         "        assert self.snapshot is not None\n",
         "tests/loop/test_optimizers.py::test_skip_policy_restores_the_buffers_the_skipped_steps_forward_changed")
mutation("several optimizers: the step counter advances", "saferun/loop/manual.py",
         "        tr.state.advance(samples)\n        return StepOutput(loss=torch.stack(losses).sum(),",
         "        return StepOutput(loss=torch.stack(losses).sum(),",
         "tests/loop/test_optimizers.py")


mutation("several optimizers: the step uses the Trainer's GradScaler", T,
         "        self._scaler, self._guard, self._schedule = update.scaler, update.guard, schedule",
         '        self._scaler, self._guard, self._schedule = torch.amp.GradScaler("cpu", enabled=False), update.guard, schedule',
         "tests/loop/test_optimizers.py::test_each_update_equals_a_hand_written_loop_bitwise")

mutation("saferun check: compile parity still compiles after the other checks", "saferun/check.py",
         "        torch.compiler.reset()\n", "        pass\n",
         "tests/guards/test_check.py::test_compile_parity_is_checked_when_the_config_compiles")
mutation("saferun check: compile parity runs the fit's own compile check", "saferun/check.py",
         "    make(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, max_steps=1))).fit()\n",
         "    make(cfg).setup()\n",
         "tests/guards/test_check.py::test_compile_parity_is_checked_when_the_config_compiles")

mutation("several optimizers: unused parameters named per optimizer", MANUAL,
         "            if unused is not None and unused.after_backward(step):",
         "            if False:",
         f"{OPTS}::test_unused_parameters_are_named_per_optimizer_once")
mutation("several optimizers: unused parameters named once", MANUAL,
         "                del self._unused[name]\n", "                pass\n",
         f"{OPTS}::test_unused_parameters_are_named_per_optimizer_once")

mutation("a checkpoint of the unreleased format 1 is refused saying so", "saferun/checkpoint/store.py",
         'manifest.get("format") == 1 and', 'manifest.get("format") == -1 and',
         "tests/checkpoint/test_checkpoint.py::test_a_checkpoint_of_the_unreleased_format_1_is_refused_saying_so_and_nothing_is_lost")
# issue 31: trackers
TRK, LIFE = "saferun/loggers/trackers.py", "tests/logging/test_tracker_lifecycle.py"
mutation("trackers: MLflow continues the run its run directory names, not the checkpoint's", TRK,
         "        mine = _run_id(view.run_dir, MLFLOW_RUN)\n", "        mine = self.run_id\n",
         f"{LIFE}::test_mlflow_a_change_of_course_gets_a_new_linked_run_and_the_old_run_keeps_its_course")
mutation("trackers: MLflow's new course holds its past up to the resumed step", TRK,
         "            self._copy_past(previous, step)", "            pass",
         f"{LIFE}::test_mlflow_a_change_of_course_gets_a_new_linked_run_and_the_old_run_keeps_its_course")
mutation("trackers: MLflow skips what the store holds metric by metric", TRK,
         "               if step > self._held.get(k, -1)]",
         "               if step > max(self._held.values(), default=-1)]",
         f"{LIFE}::test_mlflow_after_a_kill_inside_a_validation_holds_that_validation")
mutation("trackers: MLflow ends the RUNNING run of a course set aside", TRK,
         "            self._end_superseded()", "            pass",
         f"{LIFE}::test_mlflow_after_a_kill_before_the_first_checkpoint_leaves_no_running_run")
mutation("trackers: MLflow keeps each same-name text and histogram of one step", TRK,
         '(f"-{n}" if n else "")', '""',
         f"{LIFE}::test_mlflow_keeps_every_text_and_histogram_of_one_name_at_one_log_point")
mutation("trackers: W&B starts a new run where its run directory names none", TRK,
         "        mine = _run_id(view.run_dir, WANDB_RUN)\n", "        mine = self.run_id\n",
         f"{LIFE}::test_wandb_offline_logs_the_new_course_after_a_fresh_start_or_a_course_change")
mutation("trackers: MLflow does not send again the images a resumed run's store holds", TRK,
         '                if m.step > self._held_images.get(m.name.replace("/", "~"), -1):',
         "                if True:",
         "tests/logging/test_trackers.py::test_mlflow_store_holds_params_metrics_media_and_artifacts_and_a_resume_continues_the_run")
mutation("lifecycle: run_files that are not plain names are refused", "saferun/callbacks.py",
         "            if isinstance(owned, str) or not all(", "            if False and not all(",
         f"{LIFE}::test_run_files_that_are_not_plain_names_are_refused")
mutation("trackers: W&B says which metrics of a step a killed run began it cannot add", TRK,
         "            if step == self._held and set(row) - self._held_keys:",
         "            if False:",
         f"{LIFE}::test_wandb_after_a_stop_inside_a_validation_says_what_it_cannot_add")
mutation("trackers: W&B records as held only what a finished W&B run wrote", TRK,
         "        self.sent = step\n",
         '        self.sent = step\n        _write_json(self._own, {"run_id": self.run_id, "sent": step, "keys": []})\n',
         f"{LIFE}::test_wandb_after_a_sigkill_sends_every_step_after_the_checkpoint_and_says_what_it_may_lack")
mutation("trackers: W&B says which steps a killed process may have lost", TRK,
         "            if self.sent > written:", "            if False:",
         f"{LIFE}::test_wandb_after_a_sigkill_sends_every_step_after_the_checkpoint_and_says_what_it_may_lack")
mutation("trackers: W&B's new course names the previous run in its config", TRK,
         '                config["saferun"] = {"previous_run_id": self.run_id, "resumed_step": view.step}',
         "                pass",
         f"{LIFE}::test_wandb_offline_logs_the_new_course_after_a_fresh_start_or_a_course_change")
mutation("lifecycle: a fresh start sets the callbacks' run_files aside", "saferun/checkpoint/superseded.py",
         "tuple(n for n in owned if n not in RUN_FILES)", "()",
         f"{LIFE}::test_the_lifecycle_events_reach_a_callback_with_the_folder_set_aside",
         f"{LIFE}::test_wandb_offline_logs_the_new_course_after_a_fresh_start_or_a_course_change")
mutation("lifecycle: a change of course sets the callbacks' run_files aside", "saferun/checkpoint/course.py",
         "    files = [p.name for p in earlier_files(run_dir, owned)]",
         "    files = [p.name for p in earlier_files(run_dir)]",
         f"{LIFE}::test_the_lifecycle_events_reach_a_callback_with_the_folder_set_aside",
         f"{LIFE}::test_mlflow_a_change_of_course_gets_a_new_linked_run_and_the_old_run_keeps_its_course")
mutation("lifecycle: the callbacks hear of a fresh start", CKPTR,
         "                callbacks.on_fresh_start(o.view, aside)\n", "",
         f"{LIFE}::test_the_lifecycle_events_reach_a_callback_with_the_folder_set_aside",
         f"{LIFE}::test_mlflow_after_a_kill_before_the_first_checkpoint_leaves_no_running_run")
mutation("lifecycle: the callbacks hear of a change of course", CKPTR,
         "            p.callbacks.on_course_change(o.view,", "            (lambda *a: None)(o.view,",
         f"{LIFE}::test_the_lifecycle_events_reach_a_callback_with_the_folder_set_aside")

# The lifecycle grid (tests/lifecycle/): a component that keeps what a rollback undid is caught
# by its cell of the bad-step event.
mutation("lifecycle grid: metrics.jsonl keeps the lines a rollback undid", "saferun/loggers/__init__.py",
         "            os.truncate(self.path, self._length)", "            pass",
         "tests/lifecycle/test_grid.py::test_cell[metrics.jsonl|nonfinite_rollback]")


# issue 35: activation checkpointing
AC = "saferun/loop/activation_checkpointing.py"
AC_TESTS = "tests/loop/test_activation_checkpointing.py"
mutation("activation checkpointing: the recompute updates buffers once", AC,
         "        checkpoint(module, context_fn=_recompute_keeps_buffers(module))",
         "        checkpoint(module)",
         f"{AC_TESTS}::test_checkpointed_blocks_train_exactly_as_without")
mutation("activation checkpointing: the named modules are checkpointed", AC,
         "    for _, module in chosen:\n        checkpoint(", "    for _, module in chosen[:0]:\n        checkpoint(",
         f"{AC_TESTS}::test_checkpointing_keeps_fewer_activations")
mutation("activation checkpointing: an unknown class is refused", AC,
         "    if missing:\n        close", "    if False:\n        close",
         f"{AC_TESTS}::test_an_unknown_class_name_is_refused_with_the_models_classes")
mutation("activation checkpointing: only the outermost of nested matches", AC,
         ' and not any(name.startswith(f"{c}.") or c == "" for c, _ in chosen)', "",
         f"{AC_TESTS}::test_nested_matches_checkpoint_the_outermost_module_once")

# issue 31: checkpoints
SCHED_TESTS = "tests/unit/test_schedules.py"
mutation("issue 31: a second fit() re-resolves a schedule sized by the run's limits", "saferun/checkpoint/compat.py",
         "    if given is not None:\n        first, later", "    if False:\n        first, later",
         f"{SCHED_TESTS}::test_a_second_fit_with_a_schedule_sized_for_the_first_is_refused_as_a_resume_is")
mutation("issue 31: a second fit() is checked as a resume is", T,
         "        if self._fitted is not None:  # what the run was built with must still hold",
         "        if False:  # what the run was built with must still hold",
         f"{SCHED_TESTS}::test_a_second_fit_with_a_schedule_sized_for_the_first_is_refused_as_a_resume_is")
mutation("issue 31: a schedule with fewer steps than the run is refused before the first", T,
         "        check_schedule_length(self.scheduler, state.max_steps)  # OneCycleLR: before any step\n", "",
         f"{SCHED_TESTS}::test_a_schedule_with_fewer_steps_than_the_run_is_refused_before_the_first_step")
WEIGHTS = "saferun/checkpoint/weights.py"
mutation("issue 31: a run's weights file is verified against its recorded digest", WEIGHTS,
         "    record = next((r for r in records if (r.get(\"bytes\"), r.get(\"sha256\")) == (size, digest)), None)",
         "    record = next(iter(records), None)",
         BESTM + "test_a_flipped_bit_in_a_weights_file_is_refused_by_load_model_and_from_run")
mutation("issue 31: a weights file's new record is pending before the file is replaced", WEIGHTS,
         "        update_summary(str(run), {PENDING: {**_summary(run).get(PENDING, {}), **entries}})\n", "",
         BESTM + "test_after_a_kill_model_best_and_its_recorded_step_agree")
mutation("issue 31: a missing model_best.pt is reported missing", WEIGHTS,
         '    if checkpoint == "best" and (isinstance(best, dict) or', '    if False and (isinstance(best, dict) or',
         BESTM + "test_a_missing_model_best_is_reported_missing")
mutation("issue 31: test() records the weights it tested in summary.json", T,
         '            tested = {"tested": self._tested} if self._tested is not None else {}',
         "            tested = {}",
         BESTM + "test_a_test_records_the_run_the_weights_file_its_step_epoch_and_sha256")
mutation("issue 31: test() logs the weights it tested", T,
         "        if self._tested is not None and self.ranks.is_main:", "        if False:",
         BESTM + "test_a_test_records_the_run_the_weights_file_its_step_epoch_and_sha256")
mutation("issue 31: from_run's weights are at their epoch", T,
         "        self.state.epoch = weights.epoch or 0\n", "",
         BESTM + "test_a_test_records_the_run_the_weights_file_its_step_epoch_and_sha256")
NONFINITE_T = "tests/guards/test_nonfinite.py::"
mutation("issue 31: a save checks the state it would write", CKPTR,
         "        bad = guard.window_bad() or guard.state_bad(checkpointer.path())",
         "        bad = guard.window_bad()",
         NONFINITE_T + "test_a_save_never_writes_a_non_finite_parameter_or_optimizer_state")
mutation("issue 31: the save check covers the optimizer state", BADSTEP,
         "        for param, values in opt.state.items():", "        for param, values in {}.items():",
         NONFINITE_T + "test_a_save_never_writes_a_non_finite_parameter_or_optimizer_state")
mutation("issue 31: the save check covers the parameters", BADSTEP,
         '''[(f"parameter {n}", p) for n, p in model.named_parameters()]''', "[]",
         NONFINITE_T + "test_a_save_never_writes_a_non_finite_parameter_or_optimizer_state")
mutation("issue 31: the save check's verdict is agreed across ranks", BADSTEP,
         "        if distributed.on_every_rank(bad is None):\n            self._checked",
         "        if bad is None:\n            self._checked",
         "tests/parallel/test_fsdp.py::test_a_non_finite_shard_on_one_rank_refuses_the_save_on_every_rank_without_a_hang",
         known="its test is a slow torchrun launch (pytest -m slow); killed by hand when written (the ranks hang)")
mutation("issue 31: a rollback passes checkpoints that are not clean", BADSTEP,
         "        return None if distributed.on_every_rank(bad is None) else (bad or \"on another rank\")",
         "        return None",
         NONFINITE_T + "test_rollback_skips_a_newer_checkpoint_that_holds_non_finite_values")
mutation("issue 31: a refused save rolls back under rollback", BADSTEP,
         "        return policy.on_bad_window(bad)",
         "        return Verdict.RAISE if bad.in_state else policy.on_bad_window(bad)",
         NONFINITE_T + "test_rollback_after_a_refused_save_goes_to_the_newest_clean_checkpoint_and_trains_on")
mutation("issue 31: a final save rolled back is not passed off as the run's end", CKPTR,
         "        if self._owner.state.step != step:  # not finite, nothing saved: rolled back",
         "        if False:  # not finite, nothing saved: rolled back",
         NONFINITE_T + "test_a_final_state_rolled_back_is_not_passed_off_as_the_run_s_end")
mutation("issue 31: the error says whether the newest checkpoint was checked", BADSTEP,
         "                   if str(newest.resolve()) in self._checked else",
         "                   if False else",
         NONFINITE_T + "test_a_save_never_writes_a_non_finite_parameter_or_optimizer_state")


# issues 35/37: speed
COST = "tests/loop/test_loop_cost.py::test_the_loop_adds_few_python_calls_and_keeps_few_objects_per_step"
mutation("loop cost: the norm and clipping take the direct path where they can", UPD,
         "        if not self.direct:\n            return clip_or_measure(",
         "        if True:\n            return clip_or_measure(",
         "tests/loop/test_loop_cost.py::test_the_loop_adds_few_python_calls_and_keeps_few_objects_per_step")
mutation("loop cost: fit() holds the gradient accumulators", T,
         "        self._accumulators = grad_accumulators(self._params)",
         "        self._accumulators = grad_accumulators([])",
         "tests/loop/test_loop_cost.py::test_the_gradient_accumulators_live_across_steps")
mutation("loop cost: grad_accumulators finds each parameter's accumulator", UPD,
         "                    held.append(node.next_functions[0][0])", "                    pass",
         "tests/loop/test_loop_cost.py::test_the_gradient_accumulators_live_across_steps")
mutation("loop cost: nothing built per step for a step that logged only means", T,
         "self._running.add(output, where, self._logbook.take_step())",
         "self._running.add(output, where, self._logbook.take())", COST)
mutation("loop cost: the per-step event skips the callbacks that do not implement it",
         "saferun/callbacks.py",
         'self._on_step_end = [cb for cb in self.callbacks if _implements(cb, "on_train_step_end")]',
         "self._on_step_end = list(self.callbacks)", COST)
mutation("loop cost: the batch stream asks the index recorder nothing it need not", BATCHES,
         "if recorder is not None else None", "if recorder else None", COST)

THREADS, THREADT = "saferun/loop/threads.py", "tests/unit/test_threads.py"
mutation("threads: auto shares the cores among the processes on the node", THREADS,
         "max(1, cores // local - workers)", "max(1, cores - workers)",
         f"{THREADT}::test_auto_gives_each_process_its_share_of_the_cores")
mutation("threads: auto leaves the cores of the loader workers", THREADS,
         "max(1, cores // local - workers)", "max(1, cores // local)",
         f"{THREADT}::test_auto_gives_each_process_its_share_of_the_cores",
         f"{THREADT}::test_auto_counts_the_loader_workers")
mutation("threads: auto never raises the threads torch has", THREADS,
         'ThreadPlan(min(facts["share"], current),', 'ThreadPlan(facts["share"],',
         f"{THREADT}::test_auto_never_raises_the_threads_torch_has")
mutation("threads: the user's OMP_NUM_THREADS wins over auto", THREADS,
         'if _positive_int(environ.get("OMP_NUM_THREADS")):', "if False:",
         f"{THREADT}::test_the_users_omp_num_threads_wins_over_auto_and_an_explicit_value_over_both",
         f"{THREADT}::test_the_environments_omp_num_threads_is_left_as_torch_took_it")
mutation("threads: the plan is applied to torch", THREADS,
         "        torch.set_num_threads(plan.threads)\n", "",
         f"{THREADT}::test_the_trainer_sets_the_planned_threads_and_says_so_once")
mutation("threads: the command sets OpenMP's wait policy before torch loads", "saferun/cli/__init__.py",
         "    prepare_openmp()  #", "    pass  #",
         f"{THREADT}::test_the_saferun_command_stops_openmp_threads_spinning_unless_the_user_chose")
mutation("threads: the user's OMP_WAIT_POLICY wins", THREADS,
         'if "torch" in sys.modules or "OMP_WAIT_POLICY" in env:', 'if "torch" in sys.modules:',
         f"{THREADT}::test_the_saferun_command_stops_openmp_threads_spinning_unless_the_user_chose")
PERF, PERFT = "saferun/loop/throughput.py", "tests/loop/test_throughput.py"
# the step frame (loop/frame.py) and the step guards (guards/step_guards.py), issue 32/37
FRAME = "saferun/loop/frame.py"
mutation("step frame: contexts entered unless one process in fp32", FRAME,
         "        self._plain = autocast is contextlib.nullcontext and not strategy.wraps_micro_batch",
         "        self._plain = True",
         f"{STEP}::test_bf16_autocast_on_cpu")
mutation("step frame: a backward inside the first training_step is refused", T,
         "        first = [] if self._manual is not None else [FirstBackward(self._habits, self._params)]",
         "        first: list[Any] = []",
         "tests/loop/test_loop_edges.py::test_a_backward_or_optimizer_step_inside_training_step_is_refused_before_any_update")
mutation("step frame: the first steps' checks drop out when done", FRAME,
         "            self._first = [c for c in self._first if not c.done]", "            pass",
         f"{AUDITS}::test_the_audits_run_in_the_first_two_steps_only", COST)
mutation("loop cost: a list of plain values is copied without a call per value",
         "saferun/loop/transfer.py",
         "    if type(obj) in (list, tuple) and _PLAIN.issuperset(map(type, obj)):",
         "    if False:",
         "tests/unit/test_data.py::test_a_long_list_of_numbers_is_copied_without_a_call_per_number")
mutation("step guards: a skip policy's buffer snapshot is taken before each step", T,
         "            guards.register(self._guard.snapshot)", "            pass",
         f"{NONFINITE}::test_a_skipped_nan_batch_leaves_no_nan_in_the_batchnorm_statistics",
         f"{OPTS}::test_skip_policy_restores_the_buffers_the_skipped_steps_forward_changed")
mutation("step guards: several optimizers run the after-backward guards", MANUAL,
         "        for check in guards.after_backward:  # declared modes",
         "        for check in ():  # declared modes",
         f"{OPTS}::test_a_module_switched_to_eval_in_training_step_is_named_with_several_optimizers")
mutation("step guards: a guard that is done is dropped", T,
         "                guards.drop(check)  # done", "                pass  # done",
         f"{NONFINITE}::test_unused_parameters_are_named_once",
         "tests/loop/test_loop_cost.py::test_a_default_step_calls_no_guard_or_context_it_does_not_need")
mutation("GradScaler: updated once per step under fp16", T,
         "        if self._update.scaling:  # fp16: after the step", "        if False:  # fp16: after the step",
         "tests/checkpoint/test_checkpoint.py::test_grad_scaler_state_is_saved_and_restored")
mutation("perf: the first step's FLOPs are counted", T,
         "        self._frame.count_first_step(FlopCount(self._perf) if self._perf.counting else None)",
         "        self._frame.count_first_step(None)",
         f"{PERFT}::test_flops_are_counted_once_and_reported_to_every_logger")
mutation("perf: only the first step runs under the FLOP counter", PERF,
         "        if last:\n            self.done = True\n", "        if last:\n",
         f"{PERFT}::test_flops_are_counted_once_and_reported_to_every_logger")
mutation("perf: the report joins the log point's metrics", T,
         "        self._perf.at_log_point(metrics)  #", "        pass  #",
         f"{PERFT}::test_flops_are_counted_once_and_reported_to_every_logger")
mutation("perf: tokens/s from the task's tokens per sample", PERF,
         'metrics["perf/samples_per_sec"] * self.tokens_per_sample',
         'metrics["perf/samples_per_sec"]',
         f"{PERFT}::test_tokens_per_second_where_the_task_says_how_many_a_sample_holds")
mutation("perf: a GPU's peak only for the GPU itself (A10 is not A10G)", PERF,
         'if re.search(rf"\\b{re.escape(key)}\\b", name):', "if key in name:",
         f"{PERFT}::test_the_peak_is_known_for_common_gpus_only")
mutation("perf: no peak for a precision the GPU has no tensor cores for", PERF,
         "            if tflops is None or precision not in precisions:\n",
         "            if tflops is None:\n",
         f"{PERFT}::test_the_peak_is_known_for_common_gpus_only")
STEPT = "tests/loop/test_steptimer.py::"
mutation("perf: the split of the log point's step joins its metrics", T,
         "        self._timer.at_log_point(metrics, self.state.step)  #", "        pass  #",
         f"{STEPT}test_each_log_point_splits_its_step_to_every_logger")
mutation("perf: the timed step's data wait starts at the end of the step before", T,
         "                        timer.start(state.step)  # from here", "                        pass  # from here",
         f"{STEPT}test_each_log_point_splits_its_step_to_every_logger")
mutation("perf: the data wait is not counted as the forward and backward", T,
         '            timer.lap("data_wait")\n', '            timer.lap("forward_backward")\n',
         f"{STEPT}test_a_slow_data_loader_shows_as_data_wait")
mutation("perf: the optimizer's time is its own phase", T,
         '            timer.lap("optimizer")\n', '            timer.lap("guards")\n',
         f"{STEPT}test_a_slow_optimizer_step_shows_as_optimizer_time")
mutation("perf: the timed step starts after the step before's validation and save",
         "saferun/loop/steptimer.py",
         "        if starting and self.before == step:\n", "        if self.before == step:\n",
         f"{STEPT}test_logging_every_step_times_every_step_without_the_validation_before_it")
mutation("perf: several optimizers: no phase that would count another's time", "saferun/loop/steptimer.py",
         '        if not self._phases and phase != "data_wait":\n            return\n', "",
         f"{STEPT}test_several_optimizers_split_only_the_data_wait")


# issue 36: first hour
FIRST = "tests/cli/test_first_hour.py"
DOCS = "tests/test_docs.py"
mutation("first hour: a dotted name the docs write resolves after import saferun", "saferun/__init__.py",
         "    return submodule(__name__, name)\n\n\ndef submodule",
         "    raise AttributeError(name)\n\n\ndef submodule",
         f"{DOCS}::test_every_dotted_saferun_name_in_the_docs_works_after_import_saferun")
mutation("first hour: Hydra's flags may follow the overrides", "saferun/cli/compose.py",
         "    return head + tail, None", "    return list(args), None",
         f"{FIRST}::test_cfg_job_after_the_overrides_prints_the_config")
mutation("first hour: an unknown flag names the override meant", "saferun/cli/compose.py",
         '{_flags_text(flags)}.{_override_meant(word, value)}")', '{_flags_text(flags)}.")',
         f"{FIRST}::test_an_unknown_flag_names_the_override_meant")
mutation("first hour: saferun check --help prints its usage", "saferun/cli/check.py",
         '    if "-h" in args or "--help" in args:', "    if False:",
         f"{FIRST}::test_check_help_prints_its_usage")
mutation("first hour: an MLflow tracking URI is checked when the logger is built", "saferun/loggers/trackers.py",
         "        if tracking_uri:  # when built", "        if False:  # when built",
         f"{FIRST}::test_an_mlflow_server_that_is_not_there_is_refused_before_training")
mutation("first hour: a part's own refusal that names its key is passed on whole", COMPONENTS,
         "        if isinstance(cause, SaferunError) and str(cause).startswith(key):",
         "        if False:", f"{FIRST}::test_an_mlflow_server_that_is_not_there_is_refused_before_training")

UNIT_FIRST = "tests/unit/test_user_mistakes.py"
mutation("first hour: a habit's key (trainer.num_train_epochs) names saferun's", "saferun/suggest.py",
         "    if parts[-1] in HABITS:", "    if False:", f"{UNIT_FIRST}::test_a_bad_config_names_the_key_and_the_fix")
mutation("first hour: a list for logger, callbacks or metrics is refused with the form", "saferun/config.py",
         "    if isinstance(cfg, Mapping):\n        _check_named_nodes(cfg)\n", "",
         f"{UNIT_FIRST}::test_a_bad_config_names_the_key_and_the_fix")
mutation("first hour: fit(model, loader) says where they go", T,
         "        if misplaced:  # trainer.fit(model, loader)", "        if False:  #",
         f"{UNIT_FIRST}::test_fit_with_a_model_or_loader_says_where_they_go")

mutation("first hour: self.log in after_fit is refused, not dropped", T,
         '        self._logbook.closed = "after_fit"  # after the last log point: logging is refused there\n', "",
         f"{UNIT_FIRST}::test_logging_in_after_fit_is_refused_not_dropped")
mutation("first hour: test() from after_fit still logs", "saferun/loop/logbook.py",
         "        if self.closed is not None and self.phase is None:", "        if self.closed is not None:",
         f"{UNIT_FIRST}::test_test_called_from_after_fit_still_logs_its_metrics")
mutation("first hour: a text given to self.log is pointed at log_text", "saferun/loop/logbook.py",
         "    if isinstance(value, str):\n        raise SaferunError(f\"self.log({name!r}, {value!r})",
         "    if False:\n        raise SaferunError(f\"self.log({name!r}, {value!r})",
         f"{UNIT_FIRST}::test_a_text_given_to_self_log_is_pointed_at_log_text")

mutation("first hour: test()/predict() before training say the weights are the initial ones", T,
         "        self._initial_said = True\n        name = type(self).__name__\n        log.warning(",
         "        self._initial_said = True\n        name = type(self).__name__\n        (lambda *a: None)(",
         f"{UNIT_FIRST}::test_evaluating_before_any_training_says_once_that_the_weights_are_the_initial_ones")
mutation("first hour: from_run's weights are not called initial", T,
         "        trainer._tested = weights.provenance(run_dir)  # what test() records it evaluated\n", "",
         f"{UNIT_FIRST}::test_evaluating_before_any_training_says_once_that_the_weights_are_the_initial_ones")

mutation("first hour: a whole pickled model is told to save the state_dict", "saferun/checkpoint/weights.py",
         "    if pickled:  # torch.save(model)", "    if False:  # torch.save(model)",
         f"{UNIT_FIRST}::test_a_weights_file_that_is_no_state_dict_says_so_without_weights_only_false")

mutation("first hour: a sample default collate cannot batch says how to convert it", "saferun/loop/steps.py",
         "    if collate:  # in this process", "    if False:  # in this process",
         f"{UNIT_FIRST}::test_a_sample_default_collate_cannot_batch_says_how_to_convert_it")
mutation("first hour: float labels for cross_entropy are named as the labels", "saferun/diagnose/explain.py",
         '    if "expected target dtype" in message or', "    if False and",
         f"{UNIT_FIRST}::test_float_labels_for_cross_entropy_are_named_as_the_labels")

mutation("first hour: saferun test --checkpoint names checkpoint=", "saferun/cli/evaluate.py",
         '        if arg.startswith("--") and key in options:', "        if False:",
         f"{FIRST}::test_saferun_test_with_an_option_flag_names_the_key_value_form")
mutation("first hour: an Optuna search-space mistake is named before Hydra", "saferun/cli/run.py",
         "        _check_search_space(args)\n", "",
         f"{FIRST}::test_an_optuna_search_space_mistake_names_the_override_and_leaves_nothing")

mutation("first hour: optimization_results.yaml holds typed best_params", "saferun/sweep/study.py",
         '"best_params": _typed(best.user_attrs["overrides"]),', '"best_params": dict(best.user_attrs["overrides"]),',
         "tests/sweeps/test_optuna.py::test_the_best_params_are_written_as_the_values_they_stand_for")

mutation("first hour: a grid sweep's values are checked before any job", "saferun/cli/run.py",
         "search_space_problem(overrides) or grid_problem(overrides, dirs)", "search_space_problem(overrides)",
         f"{FIRST}::test_a_grid_sweep_with_one_bad_value_is_refused_before_any_job")

mutation("first hour: what Hydra's composition refuses is one error line", "saferun/cli/run.py",
         "        _check_composition(args)\n", "        pass\n",
         f"{FIRST}::test_a_mistaken_command_line_gets_one_error_line_and_leaves_nothing")


# issue 34: mesh
MESH = "tests/parallel/test_mesh.py"
MESH_PARITY = f"{MESH}::test_tensor_parallel_equals_one_process_at_every_step"
mutation("mesh: a tensor-parallel group draws one random stream (seeded per data rank)", T,
         "        if data.world_size > 1:  # dropout etc. per data rank",
         "        if self.ranks.world_size > 1:  # dropout etc. per data rank",
         MESH_PARITY, also=(("            seed_everything(derive_seed(self.cfg.seed, data.rank))",
                             "            seed_everything(derive_seed(self.cfg.seed, self.ranks.rank))"),))
mutation("mesh: the loaders split the data over the data-parallel ranks", T,
         "        data = self.data_ranks\n        return make_loaders(",
         "        data = self.ranks\n        return make_loaders(", MESH_PARITY)
mutation("mesh: self.log reductions over the data dimension only", "saferun/loop/metrics.py",
         "self.folded.reduced(device, data.group)", "self.folded.reduced(device)", MESH_PARITY)
mutation("mesh: the gradient norm of every mesh's whole tensors", "saferun/loop/update.py",
         "        norm = _combined([_global(torch.nn.utils.get_total_norm([p.grad for p in g]))",
         "        norm = _combined([torch.nn.utils.get_total_norm([getattr(p.grad, 'to_local', lambda: p.grad)() for p in g])",
         MESH_PARITY)
mutation("mesh: gradients on several meshes clipped per mesh", "saferun/loop/update.py",
         "    if meshes:\n        groups = _by_mesh(", "    if False:\n        groups = _by_mesh(", MESH_PARITY)
mutation("mesh: a stop signal on one rank reaches every rank", "saferun/parallel/agreement.py",
         "        summed = all_reduce(torch.stack(list(votes.values()))).tolist()",
         "        summed = torch.stack(list(votes.values())).tolist()",
         f"{MESH}::test_a_stop_on_one_rank_stops_both_and_the_resume_equals_the_uninterrupted_run_bitwise",
         known="its test is a slow torchrun launch (pytest -m slow); killed by hand when written "
               "(the job hangs: rank 1 saves while rank 0 trains on, until the collective timeout)")
mutation("mesh: with tensor parallel a stream is refused", "saferun/parallel/mesh.py",
         "    if train_loader is not None and isinstance(train_loader.dataset, IterableDataset):",
         "    if False:", f"{MESH}::test_with_tensor_parallel_a_stream_or_torchmetrics_are_refused_naming_them")
mutation("mesh: with tensor parallel torchmetrics are refused", "saferun/parallel/mesh.py",
         "    if metrics:\n        raise ConfigError(", "    if False:\n        raise ConfigError(",
         f"{MESH}::test_with_tensor_parallel_a_stream_or_torchmetrics_are_refused_naming_them")
mutation("mesh: from_run evaluates a mesh run's whole weights in one process", T,
         '        if strategy in ("fsdp", "mesh"):', '        if strategy == "fsdp":',
         f"{MESH}::test_a_tensor_parallel_run_is_evaluated_from_its_directory_in_one_process")
mutation("mesh: several optimizers on a mesh are refused", "saferun/loop/optimizers.py",
         '(t.strategy in ("fsdp", "mesh"), f"is {t.strategy}', '(t.strategy == "fsdp", f"is {t.strategy}',
         f"{MESH}::test_several_optimizers_on_a_mesh_are_refused_naming_the_strategy")
mutation("mesh: a checkpoint of another data split is resharded, not read by rank", CKPTR,
         '        saved = tuple(state.get("layout") or (len(state["per_rank"]),) * 2)',
         '        saved = (len(state["per_rank"]),) * 2', f"{MESH}::test_a_checkpoint_of_another_data_split_"
         "on_as_many_processes_is_resharded_not_misread")
mutation("mesh: parallelize must return the model it was given", "saferun/parallel/mesh.py",
         "    if out is not model:", "    if False:",
         f"{MESH}::test_a_plan_that_replaces_the_model_or_splits_nothing_is_refused")
mutation("mesh: a tensor-parallel plan that splits nothing is refused", "saferun/parallel/mesh.py",
         "    if layout.tp > 1 and not any(", "    if False and not any(",
         f"{MESH}::test_a_plan_that_replaces_the_model_or_splits_nothing_is_refused")
mutation("mesh: a mesh that does not fit the job is refused", "saferun/parallel/mesh.py",
         "        if dp * p.tp != ranks.world_size:", "        if False:",
         f"{MESH}::test_a_mesh_that_does_not_fit_the_job_is_refused_naming_the_key")
# issue 34: trainer.ema on a mesh and under fsdp (the average sharded like the parameters)
FSDP_EMA = "tests/parallel/test_fsdp.py::test_the_weight_average_is_kept_in_shards_and_equals_the_average_of_the_weights"
MESH_RESHARD = f"{MESH}::test_a_checkpoint_of_another_data_split_on_as_many_processes_is_resharded_not_misread"
mutation("sharded ema: each rank averages its own shards after each step", AVG,
         "        _average(optimizer, self._avg, self._ema, _local(self._raw), self._ema_copied,",
         "        _average(optimizer, self._avg, self._ema, self._ema, self._ema_copied,",
         FSDP_EMA, MESH_PARITY)
mutation("sharded ema: validated with the averaged shards in the model", AVG,
         "            kept = [t.clone() for t in raw]\n            torch._foreach_copy_(raw, ema)\n",
         "            kept = [t.clone() for t in raw]\n", FSDP_EMA, MESH_PARITY)
mutation("sharded ema: the trained weights are put back after its validation", AVG,
         "            with torch.no_grad():\n                torch._foreach_copy_(raw, kept)\n",
         "            pass\n", FSDP_EMA, MESH_PARITY)
mutation("sharded ema: model_ema.pt is the average gathered whole", AVG,
         "            gathered = t.full_tensor() if is_dtensor(t) else t",
         "            gathered = t.to_local() if is_dtensor(t) else t", FSDP_EMA, MESH_PARITY)
mutation("sharded ema: saved with the checkpoint's shards", "saferun/checkpoint/sharded.py",
         '            if ema is not None:\n                shards["ema"] = ema\n', "", FSDP_EMA, MESH_RESHARD)
mutation("sharded ema: resumed (resharded) from the checkpoint's shards", "saferun/checkpoint/sharded.py",
         '    with_ema = ema is not None and info.get("ema", False)',
         "    with_ema = False", MESH_RESHARD)

# issue 31: direction, sweeps, course
DIRECTION = "tests/checkpoint/test_direction.py::"
mutation("direction: save_best infers its direction from the metric's name", "saferun/config.py",
         '        return metric_mode(self.save_best or "", self.save_best_mode,',
         '        return self.save_best_mode or "min"\n        return metric_mode(self.save_best or "", self.save_best_mode,',
         DIRECTION + "test_save_best_of_an_accuracy_keeps_the_highest_and_says_so_once",
         DIRECTION + "test_a_sweep_on_save_best_val_r2_stars_the_highest_job")
mutation("direction: the direction a name says is used by the sweep objective and EarlyStopping",
         "saferun/direction.py", "    return inferred[0]\n", '    return "min"\n',
         DIRECTION + "test_a_sweep_on_save_best_val_r2_stars_the_highest_job",
         DIRECTION + "test_early_stopping_on_an_accuracy_goes_on_while_it_rises")
mutation("direction: a name component matches whole (val/mape is an error, not a map)",
         "saferun/direction.py", 're.split(r"[^a-z0-9]+", metric.lower())', 're.split(r"[^a-z]+", metric.lower())',
         DIRECTION + "test_the_direction_a_name_says")
mutation("direction: a name pointing both ways or blurred says none", "saferun/direction.py",
         "    if len(found) != 1:\n        return None\n", "    if not found:\n        return None\n",
         DIRECTION + "test_the_direction_a_name_says")
mutation("direction: an unknown name is refused at config time", "saferun/config.py",
         "            self.best_mode()  # now:", "            pass  # now:",
         DIRECTION + "test_a_name_without_a_direction_is_refused_naming_the_setting")
mutation("direction: the inference is said once", "saferun/checkpoint/checkpointer.py",
         "            self._unsaid = False\n        except BaseException as e:",
         "        except BaseException as e:",
         DIRECTION + "test_save_best_of_an_accuracy_keeps_the_highest_and_says_so_once",
         DIRECTION + "test_a_given_mode_wins_over_the_name",
         also=(("saferun/checkpoint/checkpointer.py", "            if self._unsaid and o.ranks.is_main:",
                "            if o.ranks.is_main:"),))
mutation("direction: EarlyStopping infers its direction from the monitored name", "saferun/stopping.py",
         "        self.mode = metric_mode(monitor, mode,", '        self.mode = mode or "min" if True else metric_mode(monitor, mode,',
         DIRECTION + "test_early_stopping_on_an_accuracy_goes_on_while_it_rises")
mutation("direction: EarlyStopping refuses a checkpointed best of the other mode", "saferun/stopping.py",
         "        if saved != self.mode and state", "        if False and state",
         DIRECTION + "test_early_stopping_refuses_a_checkpointed_best_of_the_other_mode")
mutation("direction: restore_best's mismatch names the side the name disagrees with", "saferun/stopping.py",
         "        elif self.mode != named[0]:", "        elif self.mode == named[0]:",
         DIRECTION + "test_restore_best_names_the_fix_on_the_side_that_is_wrong")
mutation("direction: restore_best compares the resolved directions", "saferun/stopping.py",
         "        if best_mode == self.mode:\n            return\n",
         '        if trainer.get("save_best_mode") == self.mode:\n            return\n',
         DIRECTION + "test_restore_best_with_an_inferred_direction_on_both_sides_restores_the_highest")
mutation("direction: a resume compares the checkpoint's direction as resolved", "saferun/checkpoint/checkpointer.py",
         "        before = (saved.get(\"save_best\"), saved_best_mode(saved))",
         "        before = (saved.get(\"save_best\"), saved.get(\"save_best_mode\") or \"min\")",
         DIRECTION + "test_a_resume_that_would_infer_another_mode_than_the_checkpoints_is_refused",
         DIRECTION + "test_a_resume_keeps_the_best_when_the_mode_was_given_then_inferred")
mutation("direction: a resume that would infer another direction than the checkpoint's is refused",
         "saferun/checkpoint/checkpointer.py",
         "        if before[0] == t.save_best and t.save_best_mode is None:",
         "        if False:",
         DIRECTION + "test_a_resume_that_would_infer_another_mode_than_the_checkpoints_is_refused")

OPTUNA = "tests/sweeps/test_optuna.py::"
mutation("sweeps: a continued study continues its sampler's stream", "saferun/sweep/study.py",
         "    continue_sampler(study, sampler)\n", "",
         OPTUNA + "test_a_continued_study_draws_on_as_an_uninterrupted_one")
mutation("sweeps: the sampler's state is saved before its trials run", "saferun/sweep/study.py",
         "        save_sampler(study, sampler)  # before", "        pass  # before",
         OPTUNA + "test_a_continued_study_draws_on_as_an_uninterrupted_one")
mutation("sweeps: a study without this sampler's state is seeded from the study", "saferun/sweep/study.py",
         "instantiate(configured, seed=int(seed) + trials)", "instantiate(configured)",
         OPTUNA + "test_a_study_without_this_samplers_state_is_seeded_from_the_study")

KILLED_EARLY = TCOURSE + "::test_a_change_of_course_killed_before_its_record_is_made_by_resume_auto"
INTENT_GOES = TCOURSE + "::test_an_intent_goes_with_a_refusal_an_evaluation_or_another_start"
mutation("course: resume=PATH makes its intent durable when the Trainer is made", CKPTR,
         "            intent.intend(t.run_dir, owner.cfg.resume, owner.ranks.is_main)", "            pass",
         KILLED_EARLY)
mutation("course: resume=auto carries out a killed run's intent", CKPTR,
         "        self.carried_intent = intent.intended(o.state.run_dir) \\", "        self.carried_intent = None \\",
         KILLED_EARLY)
mutation("course: a carried-out intent changes course (sets the superseded course aside)", CKPTR,
         " or course.interrupted(o.state.run_dir) or self.carried_intent \\",
         " or course.interrupted(o.state.run_dir) \\", KILLED_EARLY)
mutation("course: an intent naming no checkpoint is refused, not a fresh start", CKPTR,
         "        if found is None and self.carried_intent is not None:", "        if False:", INTENT_GOES)
mutation("course: a refusal in find_resume drops the refused run's intent", CKPTR,
         "        except SaferunError:\n            self._drop_own_intent()\n",
         "        except SaferunError:\n", INTENT_GOES)
mutation("course: a refusal in begin_run drops the refused run's intent", CKPTR,
         "            if isinstance(e, SaferunError):  # refused", "            if False:  # refused", INTENT_GOES)
mutation("course: an evaluation drops its intent", CKPTR,
         "        self._drop_own_intent()  # an evaluation changes no course\n", "", INTENT_GOES)
mutation("course: a start from step 0 drops an earlier intent", CKPTR,
         "                intent.drop_intent(o.state.run_dir, o.ranks.is_main)  # this start replaces it\n", "",
         INTENT_GOES)
mutation("course: a change with nothing to supersede drops its intent", COURSE,
         "    if record is None:  # nothing supersedes: the intent is done", "    if False:  # nothing supersedes",
         INTENT_GOES)
mutation("course: the change's end drops the intent with the record", COURSE,
         "        fsync_dir(Path(run_dir))\n    drop_intent(run_dir, main)\n", "        fsync_dir(Path(run_dir))\n",
         KILLED_EARLY)
mutation("course: the command line writes the intent before torch is imported", "saferun/cli/run.py",
         "        return run_dir if intent.intend(run_dir, resume, main) and main else None",
         "        return None",
         TCOURSE + "::test_from_the_command_line_a_change_killed_in_its_start_up_is_made_by_resume_auto",
         known="its test is slow (pytest -m slow, command-line runs); killed by hand when written")
mutation("course: the command line writes the intent once Hydra composed the config", "saferun/cli/run.py",
         "    intended = intent.intend(HydraConfig.get().runtime.output_dir,",
         "    intended = (lambda *written: True)(HydraConfig.get().runtime.output_dir,",
         TCOURSE + "::test_from_the_command_line_a_change_killed_in_its_start_up_is_made_by_resume_auto",
         known="its test is slow (pytest -m slow, command-line runs); killed by hand when written")
mutation("course: a command refused before its job drops its intent", "saferun/cli/run.py",
         "        if intended is not None and not _JOB_STARTED:", "        if False:",
         TCOURSE + "::test_from_the_command_line_a_refused_change_leaves_no_intent",
         known="its test is slow (pytest -m slow, command-line runs); killed by hand when written")
mutation("course: the command line drops a refused run's intent", "saferun/cli/run.py",
         "        if intended:  # refused", "        if False:  # refused",
         TCOURSE + "::test_from_the_command_line_a_refused_change_leaves_no_intent",
         known="its test is slow (pytest -m slow, a command-line run); killed by hand when written")

# issue 33: real architectures
REAL, DC, SYNCS = "tests/guards/test_real_models.py", "saferun/guards/datachecks.py", "saferun/guards/syncs.py"
CHK = "saferun/check.py"
mutation("saferun check: several optimizers' training_step runs for its forward alone", "saferun/trainer.py",
         "        with self._manual.replaying(False):", "        with torch.enable_grad():",
         "tests/guards/test_check.py::test_a_trainer_with_several_optimizers_gets_the_checks_that_run_training_step")
mutation("batch independence: a point counts only if it follows the batch's samples", DC,
         "    return a is not None and b is not None and a.shape == b.shape and bool(torch.equal(a, b))",
         "    return False",
         f"{REAL}::test_batch_independence_says_not_checked_when_nothing_reaches_the_output")
mutation("batch independence: not checked unless a point reaches the output", DC,
         "    if not reached:\n", "    if False:\n",
         f"{REAL}::test_batch_independence_says_not_checked_when_nothing_reaches_the_output")
mutation("batch independence: the module that mixes the batch is named", DC,
         "              if w == \"input\" and others and not mixes.get((m, \"output\", n), [1])}",
         "              if False}",
         f"{REAL}::test_batch_mixing_in_llama_is_caught_and_a_clean_llama_is_tested")
mutation("batch independence: a BatchNorm without running stats mixes by design", DC,
         "    return isinstance(module, _NORMS) and not module.track_running_stats",
         "    return False", f"{REAL}::test_batchnorm_without_running_stats_is_by_design")
mutation("batch independence: the model called as training_step calls it", CHK,
         "    if called is not None:\n        args, kwargs = called\n",
         "    if False:\n        args, kwargs = called  # type: ignore[misc]\n",
         f"{REAL}::test_batch_independence_without_predict_step_uses_the_model_call")
mutation("batch independence: a failing predict_step is named, not a failure", CHK,
         "            raise _NotChecked(\n", "            raise SaferunError(\n",
         f"{REAL}::test_a_failing_predict_step_is_named_and_not_a_failure")
mutation("input baseline: a keyword-only model call has its first input zeroed", DC,
         "        if not args and first is not None and isinstance(kwargs[first], torch.Tensor):",
         "        if False:",
         f"{REAL}::test_input_baseline_runs_on_a_model_called_with_keywords_only")
mutation("initial loss: a ModelOutput's logits are compared", DC,
         '        output = output.get("logits")', "        output = None",
         f"{REAL}::test_initial_loss_is_compared_on_a_model_output_with_logits")
mutation("unused parameters: over a window, not the first step", "saferun/guards/unused.py",
         "        if self.waiting and self.seen >= self.window:", "        if self.waiting:",
         f"{REAL}::test_routed_experts_are_not_called_unused_but_a_never_routed_one_is")
mutation("host syncs: a library read names the user's call", SYNCS,
         "            return site + _caller_outside_libraries(frame) if _in_library(filename) else site",
         "            return site", f"{REAL}::test_a_library_sync_names_the_users_call")
mutation("host syncs: a read of a host-only tensor is not a sync", SYNCS,
         "        if not counter._is_host(args[0] if args else None):", "        if True:",
         f"{REAL}::test_host_only_reads_and_cpu_only_checks_are_not_syncs",
         f"{REAL}::test_wav2vec2_layerdrop_is_not_a_sync")
mutation("host syncs: a host tensor written from device data is device data", SYNCS,
         "                counter._forget_host(out if func is not torch.Tensor.__setitem__ else args[0])",
         "                pass", "tests/guards/test_syncs.py::test_a_host_buffer_filled_with_device_values_is_counted_at_each_read")
mutation("host syncs: an assignment into a host tensor is a write", SYNCS,
         "out if func is not torch.Tensor.__setitem__ else args[0])", "out)",
         "tests/guards/test_syncs.py::test_a_host_buffer_filled_with_device_values_is_counted_at_each_read")
mutation("host syncs: a value check torch makes on CPU only is not a sync", SYNCS,
         "            counter._in_read |= skip_check\n", "            counter._in_read |= False\n",
         f"{REAL}::test_host_only_reads_and_cpu_only_checks_are_not_syncs")
mutation("host syncs: a batch moved to the device is device data", SYNCS,
         "                counter._host.pop(id(out), None)  # moved", "                pass  # moved",
         "tests/guards/test_audits.py::test_the_loss_audit_reads_twice_once_per_fit_and_the_loop_stays_sync_free")
mutation("eval purity: an attribute each forward writes anew is an output", "saferun/guards/purity.py",
         "            model, before.outputs | rewritten(before, model))",
         "            model, before.outputs)",
         f"{REAL}::test_a_detached_output_kept_on_the_module_is_not_state")
mutation("saferun check: eval purity after training's first forward", CHK,
         "    _first_forward(trainer, cfg.seed)\n", "",
         f"{REAL}::test_a_detached_output_kept_on_the_module_is_not_state")
mutation("model audit: a tensor with one row per sample is not state", "saferun/guards/model_audit.py",
         "                    and not (rows > 1 and value.ndim >= 1 and value.shape[0] == rows):",
         ":", f"{REAL}::test_a_detached_output_kept_on_the_module_is_not_state")
mutation("frozen by hand: only a BatchNorm is named, not a Dropout", DC,
         "                  if isinstance(m, _NORMS) and m.track_running_stats]",
         "                  if isinstance(m, _NORMS + _DROPOUTS)]",
         f"{REAL}::test_a_frozen_backbone_with_dropout_and_adapters_is_not_told_to_go_to_eval")
mutation("data overlap: low-cardinality inputs are not a leak", DC,
         "    if checked_train and 2 * len(seen) <= checked_train:", "    if False:",
         f"{REAL}::test_low_cardinality_inputs_are_not_a_leak")
mutation("batch order: batches of one sample are not judged", DC,
         "    if all(len(y) < 2 for y in labels):", "    if False:",
         f"{REAL}::test_batch_order_is_not_judged_at_batch_size_one")
ZM = "tests/guards/test_zoo_mistakes.py"
mutation("optimizer: a parameter outside the model is refused, any optimizer", "saferun/loop/manual.py",
         '    check_held({"": trainer.optimizer}, model)  # any optimizer class, as for several\n', "",
         f"{ZM}::test_an_optimizer_over_another_models_parameters_is_refused",
         f"{ZM}::test_an_optimizer_over_part_of_a_trainable_model_is_refused")
mutation("optimizer: a parameter group that matches nothing is refused", "saferun/loop/optimizers.py",
         '            if not group["params"]:', "            if False:",
         f"{ZM}::test_a_parameter_group_that_matches_no_parameter_is_refused")
mutation("model audit: a graph kept on the Trainer is named", "saferun/guards/model_audit.py",
         "        if value.grad_fn is not None:\n            yield path, value",
         "        if False:\n            yield path, value",
         f"{ZM}::test_a_graph_kept_on_the_trainer_is_named")
mutation("habits: a scheduler step in training_step is refused", "saferun/loop/habits.py",
         '                "step": self._refused(cls.step, f"{cls.__name__}.step()"),',
         '                "step": cls.step,',
         f"{ZM}::test_the_loops_own_jobs_in_training_step_are_refused_before_anything_changes")
mutation("habits: zero_grad in training_step is refused", "saferun/loop/habits.py",
         "            opt.zero_grad = self._refused(  # type: ignore[method-assign]\n"
         '                opt.zero_grad, f"{type(opt).__name__}.zero_grad()")\n', "",
         f"{ZM}::test_the_loops_own_jobs_in_training_step_are_refused_before_anything_changes")
mutation("habits: gradient clipping in training_step is refused", "saferun/loop/habits.py",
         "        _refuse_clipping()\n", "",
         f"{ZM}::test_the_loops_own_jobs_in_training_step_are_refused_before_anything_changes")
mutation("loss audit: padding the loss does not ignore names ignore_index", "saferun/guards/loss_audit.py",
         "    if len(values) == 1 and int(bad.sum()) > 1 and values[0] < 0 or \\\n",
         "    if False and len(values) == 1 and int(bad.sum()) > 1 and values[0] < 0 or False and \\\n",
         f"{ZM}::test_padding_labels_the_loss_does_not_ignore_name_ignore_index")
mutation("initial loss: raw inputs are named as the cause", DC,
         "    if not seen or not seen[0][1] > RAW_STD:", "    if True:",
         f"{ZM}::test_raw_pixel_values_are_named_as_the_cause")
mutation("setup: a validation loader that drops samples is named", DC,
         "    if kept >= n:\n        return None", "    if True:\n        return None",
         f"{ZM}::test_a_validation_loader_that_drops_samples_is_named")
mutation("model audit: a BatchNorm at a batch of one sample is named", "saferun/guards/model_audit.py",
         "        if module.training and isinstance(x, torch.Tensor) and x.ndim >= 2 and x.shape[0] == 1:",
         "        if False:", f"{ZM}::test_batchnorm_at_an_effective_batch_of_one_is_named")


# issue 33: a Trainer named on the command line without a recipe
mutation("command line: task._target_ without a recipe says the digits recipe's settings stay",
         "saferun/cli/compose.py", "    if not sets_task or chooses:\n        return None",
         "    if True:\n        return None",
         "tests/cli/test_first_hour.py::test_a_trainer_named_without_a_recipe_is_told_it_keeps_the_default_recipes_settings")


# issue 31: trackers after the merge
GRID = "tests/lifecycle/test_grid.py::test_cell"
mutation("trackers: a rollback moves MLflow to a new run holding the history up to the restored step",
         TRK, "        if self._rolled_back is None:\n            return\n",
         "        if True:\n            return\n", f"{GRID}[mlflow|nonfinite_rollback]")
mutation("trackers: MLflow's checkpointed state names the latest step sent before the save", TRK,
         '        return {"run_id": self.run_id, "sent": self._sent}',
         '        return {"run_id": self.run_id, "sent": 10**9}', f"{GRID}[mlflow|nonfinite_rollback]")
mutation("trackers: MLflow's new run (course change, rollback) holds the media up to its step", TRK,
         "        self._copy_media(previous, step)\n", "",
         f"{GRID}[mlflow media|course_same_dir]")
mutation("trackers: MLflow's new run copies no media after its step", TRK,
         "                    if _media_step(name) <= step:", "                    if True:",
         f"{GRID}[mlflow media|nonfinite_rollback]")
mutation("trackers: W&B after a kill names from which step it may lack what was sent", TRK,
         '"%d on it gets every step.", self.run_id, written + 1, self.sent,',
         '"%d on it gets every step.", self.run_id, self.sent, self.sent,',
         f"{GRID}[wandb|sigkill]")
mutation("trackers: W&B's resume reads the latest step W&B wrote from its own transaction log", TRK,
         "            written = max(self._held, wandb_latest_step(view.run_dir, self.run_id))",
         "            written = self._held", f"{GRID}[wandb|sigkill]")
mutation("trackers: W&B's transaction log: the step of a history row under nested_key", TRK,
         '                         if (i.key or "/".join(i.nested_key)) == "_step"]',
         '                         if i.key == "_step"]', f"{GRID}[wandb|sigkill]")

mutation("layout: no two packages import each other both ways", "saferun/loop/optimizers.py",
         "from ..errors import CheckpointError, ConfigError, SaferunError",
         "from ..checkpoint.store import CheckpointError\nfrom ..errors import ConfigError, SaferunError",
         "tests/test_layout.py::test_no_two_packages_import_each_other")
mutation("layout: a config is checked without importing torch", "saferun/config.py",
         "from .errors import ConfigError\n",
         "from .errors import ConfigError\nfrom .loop import averaging  # noqa: F401\n",
         "tests/test_layout.py::test_a_config_is_checked_without_importing_torch")

mutation("layout: no test reads a Trainer private attribute", "tests/loop/test_step.py",
         "t.scaler.get_scale()", "t._scaler.get_scale()",
         "tests/test_layout.py::test_no_test_reads_the_trainers_private_state")
mutation("Trainer.scaler before setup says to call setup()", T,
         "        if not self._is_setup:\n            raise SaferunError(f\"Trainer.{name} is built by setup()",
         "        if False:\n            raise SaferunError(f\"Trainer.{name} is built by setup()",
         "tests/loop/test_precision.py::test_the_step_after_a_skipped_step_works_under_a_grad_scaler")

mutation("layout: every error class is in errors.py", "saferun/guards/model_audit.py",
         "from ..errors import ModelStateError\n",
         "from ..errors import SaferunError\n\n\nclass ModelStateError(SaferunError):\n    pass\n",
         "tests/test_layout.py::test_every_error_class_is_in_errors_py")

mutation("a _target_ under a moved saferun module names where it is now", "saferun/config.py",
         "for old, new in MOVED.items() if target.startswith(old)), \"\")",
         "for old, new in MOVED.items() if False), \"\")",
         "tests/unit/test_config.py::test_a_target_under_a_moved_saferun_module_names_where_it_is_now")
# ---------------------------------------------------------------- issue 32: seams (verdicts, storage)
STORE, STORAGE_T = "saferun/checkpoint/store.py", "tests/checkpoint/test_storage.py"
STORAGE_RUN = f"{STORAGE_T}::test_a_run_saved_and_resumed_through_another_storage_is_the_uninterrupted_run"
mutation("storage: checkpoints are listed through the storage", STORE,
         "    if not storage.isdir(root):\n        return []", "    if not root.is_dir():\n        return []",
         STORAGE_RUN, f"{STORAGE_T}::test_no_checkpoint_file_is_reached_but_through_the_storage[checkpoint/store.py]")
mutation("storage: a checkpoint's state is read through the storage", STORE,
         "        with storage.open_read(state_path) as f:", '        with open(state_path, "rb") as f:',
         STORAGE_RUN)
mutation("storage: a checkpoint's state is written through the storage", STORE,
         '        written = write_tensor_file(tmp / "state.pt", state, storage)',
         '        written = write_tensor_file(tmp / "state.pt", state)', STORAGE_RUN)
mutation("storage: rotation deletes through the storage", STORE,
         "        if path.resolve() not in kept:\n            storage.remove(path)",
         "        if path.resolve() not in kept:\n            shutil.rmtree(path, ignore_errors=True)",
         STORAGE_RUN)
mutation("storage: the Trainer's storage is the Checkpointer's", T,
         "        self._checkpointer = Checkpointer(self, self._stateful_parts, storage or LOCAL)",
         "        self._checkpointer = Checkpointer(self, self._stateful_parts)", STORAGE_RUN)
RESUME_T = "tests/checkpoint/test_resume.py::test_resume_with_a_different_skip_policy_is_refused"
mutation("policies: skip drops steps (a resume compares the spike settings)", "saferun/guards/policies.py",
         '    name = "skip"\n    skips = True\n    drops_steps = True\n', '    name = "skip"\n    skips = True\n',
         RESUME_T)
mutation("policies: rollback drops steps (a resume compares the spike settings)", "saferun/guards/policies.py",
         '    needs_checkpoint = True\n    drops_steps = True\n', '    needs_checkpoint = True\n', RESUME_T)
mutation("verdicts: the rollback verdict rolls back", T,
         "        if guard.verdict(bad) is Verdict.ROLL_BACK:", "        if False:",
         f"{NONFINITE}::test_rollback_restores_the_last_checkpoint_and_goes_on")
mutation("tensorboard: a test() writer outside fit sorts after the fit's file", "saferun/loggers/__init__.py",
         "        if earlier and mine and min(mine) < max(earlier):  # read first, the fit's START would",
         "        if False:  # read first, the fit's START would",
         "tests/loop/test_test_stage.py::test_test_metrics_outside_fit_stay_in_tensorboard_when_their_file_would_sort_first")
mutation("threads: auto leaves out the cores other work keeps busy", "saferun/loop/threads.py",
         "        facts.update(share=share - busy, busy=busy)", "        facts.update(busy=busy)",
         "tests/unit/test_threads.py::test_auto_alone_on_the_node_leaves_out_the_cores_other_work_keeps_busy")
mutation("threads: other work is measured only where it can change the plan", "saferun/loop/threads.py",
         "    if busy_elsewhere is not None and local == 1 and min(share, current) > 1:",
         "    if busy_elsewhere is not None:",
         "tests/unit/test_threads.py::test_other_work_is_measured_only_where_it_can_change_the_plan")
mutation("threads: the measure leaves out this process's own time", "saferun/loop/threads.py",
         "    return max(0.0, busy / total * len(mine) - own / seconds)",
         "    return max(0.0, busy / total * len(mine))",
         "tests/unit/test_threads.py::test_a_process_spinning_beside_this_one_is_measured_as_a_busy_core_and_this_one_is_not")

# ---------------------------------------------------------------- issue 37: the step's end, the samples
mutation("trainer.save_every_n_steps saves at its steps", T,
         "                stepped and save_every is not None and state.step % save_every == 0):",
         "                stepped and save_every is not None and False):",
         "tests/test_event_order.py::test_two_epochs_with_logging_validation_and_checkpoints")
mutation("an overridden batch_size counts the step's samples", T,
         "        default = type(self).batch_size is Trainer.batch_size and \"batch_size\" not in vars(self)",
         "        default = True",
         "tests/loop/test_batch_sizes.py::test_a_count_that_is_not_a_whole_number_is_refused")
mutation("a batch_size set on the instance counts the step's samples", T,
         "        default = type(self).batch_size is Trainer.batch_size and \"batch_size\" not in vars(self)",
         "        default = type(self).batch_size is Trainer.batch_size",
         "tests/loop/test_batch_sizes.py::test_a_batch_size_set_on_the_instance_counts_the_samples_too")


# ---------------------------------------------------------------- the runner

def stale_snippets(repo: Path, m: Mutation) -> list[str]:
    """Describe each edit whose snippet does not occur exactly once (after the edits before it)."""
    texts: dict[str, str] = {}
    problems = []
    for file, old, new in m.edits:
        if file not in texts:
            if not (repo / file).is_file():
                return [f"{file} does not exist"]
            texts[file] = (repo / file).read_text()
        if texts[file].count(old) != 1:
            problems.append(f"{old.strip()[:60]!r} occurs {texts[file].count(old)} times in {file}")
        texts[file] = texts[file].replace(old, new)
    return problems


def missing_tests(chosen: list[Mutation]) -> set[str]:
    """The named tests (node ids or files) that no longer exist: renamed or removed."""
    named = sorted({t for m in chosen for t in m.tests})
    files = sorted({t.split("::")[0] for t in named if (ROOT / t.split("::")[0]).is_file()})
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", "-n", "0", "-m", "", *files],
                          cwd=ROOT, capture_output=True, text=True)
    ids = [line.strip() for line in proc.stdout.splitlines() if "::" in line]
    return {t for t in named if not (ROOT / t.split("::")[0]).is_file()
            or ("::" in t and not any(i == t or i.startswith(t + "[") for i in ids))}


def apply(repo: Path, m: Mutation) -> dict[Path, str]:
    """Edit the copy; return the original text of each file changed."""
    originals: dict[Path, str] = {}
    for file, old, new in m.edits:
        path = repo / file
        originals.setdefault(path, path.read_text())
        path.write_text(path.read_text().replace(old, new))
    return originals


def run_tests(repo: Path, tests: tuple[str, ...], timeout: int) -> tuple[str, float, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "tests")]),
           "OMP_NUM_THREADS": "1"}
    # one process (-n 0): a mutant's few tests start sooner than in a worker per core; `-m`:
    # the tests an entry names run even where the default run leaves them out (slow ones)
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-n", "0",
           "-m", "not cuda", *tests]
    start = time.time()
    try:
        proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return "killed (timeout)", time.time() - start, ""
    seconds = time.time() - start
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    status = {0: "SURVIVED", 1: "killed", 5: "error: no test ran"}.get(
        proc.returncode, f"error: pytest exit {proc.returncode}")
    return status, seconds, tail[0]


def copy_repo(dest: Path) -> Path:
    repo = dest / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(
        ".venv", ".git", "runs", "outputs", "__pycache__", "*.egg-info", ".pytest_cache"))
    probe = subprocess.run([sys.executable, "-c", "import saferun; print(saferun.__file__)"],
                           cwd=repo, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(repo)})
    if not probe.stdout.strip().startswith(str(repo)):
        sys.exit(f"the copy is not what Python imports: {probe.stdout or probe.stderr}")
    return repo


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("words", nargs="*", help="run the mutations whose name contains a word")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--stale", action="store_true",
                        help="only check that the snippets and the named tests still exist")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip running the tests once unmutated first")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per mutation")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.words or any(w in m.name for w in args.words)]
    if args.list:
        for m in chosen:
            print(f"{m.name:70s} {m.file}{'  [known: ' + m.known + ']' if m.known else ''}")
        return 0
    missing = missing_tests(chosen)
    stale = [m for m in chosen if stale_snippets(ROOT, m) or set(m.tests) & missing]
    for m in stale:
        problems = stale_snippets(ROOT, m) + [f"no test {t}" for t in m.tests if t in missing]
        print(f"stale     {m.name}: {'; '.join(problems)}")
    if args.stale:
        print(f"{len(chosen) - len(stale)} of {len(chosen)} snippets match exactly once.")
        return 1 if stale else 0
    results: list[tuple[Mutation, str, float, str]] = []
    with tempfile.TemporaryDirectory(prefix="saferun-mutate-") as tmp:
        repo = copy_repo(Path(tmp))
        if not args.no_baseline:
            tests = tuple(dict.fromkeys(t for m in chosen if m.known is None and m not in stale
                                        for t in m.tests))
            status, seconds, tail = run_tests(repo, tests, args.timeout * 4)
            print(f"baseline ({len(tests)} test selections, unmutated): {tail} [{seconds:.0f} s]",
                  flush=True)
            if status != "SURVIVED":
                print("the tests fail without any mutation: fix that first.")
                return 1
        for m in chosen:
            if m in stale:
                continue
            if m.known:
                results.append((m, "not run", 0.0, ""))
                print(f"{'not run':18s} {0:6.0f} s  {m.name}  [known: {m.known}]", flush=True)
                continue
            originals = apply(repo, m)
            try:
                status, seconds, tail = run_tests(repo, m.tests, args.timeout)
            finally:
                for path, text in originals.items():
                    path.write_text(text)
            results.append((m, status, seconds, tail))
            note = f"  [known: {m.known}]" if m.known and status == "SURVIVED" else ""
            print(f"{status:18s} {seconds:6.0f} s  {m.name}{note}", flush=True)
    survivors = [m for m, s, _, _ in results if s == "SURVIVED"]
    errors = [m for m, s, _, _ in results if s.startswith("error")]
    print(f"\n{len(results)} mutations: {sum(s.startswith('killed') for _, s, _, _ in results)} "
          f"killed, {len(survivors)} survived, {len(errors)} errors, {len(stale)} stale, "
          f"{sum(s == 'not run' for _, s, _, _ in results)} not run (known).")
    for m in survivors:
        print(f"  SURVIVED: {m.name} ({m.file}); tests: {' '.join(m.tests)}")
    for m in errors:
        print(f"  error: {m.name}")
    return 1 if survivors or stale or errors else 0


if __name__ == "__main__":
    sys.exit(main())
