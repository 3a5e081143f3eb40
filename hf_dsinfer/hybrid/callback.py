"""``HybridEngineCallback``: the Hybrid Engine inside transformers' ``Trainer`` / ``Seq2SeqTrainer``.

While training runs, ``generate`` on the trained model (the ``PeftModel`` and the HF model inside it) is routed to a
:class:`~hf_dsinfer.HybridEngine`: the call runs on the fused inference copy, refreshed from the current training
weights. This covers

* evaluation / prediction that generates (``Seq2SeqTrainer(predict_with_generate=True)``, or a ``prediction_step``
  that calls ``model.generate``): the engine switches in once, at the first ``generate`` of the evaluation, and back
  when the evaluation ends (``on_evaluate`` / ``on_predict``), so the weights are copied once per evaluation;
* a user's own ``model.generate`` during a training step (e.g. in ``compute_loss``, RL-style), and TRL's rollouts
  (GRPOTrainer / RLOOTrainer call ``generate`` inside ``training_step``, or ``generate_batch`` with
  ``use_transformers_continuous_batching=True``, both routed): switched in for that call and back right after it,
  with the training model back in the mode it had.

Trainer has no "evaluation begins" event: ``control.should_evaluate`` at ``on_step_end`` / ``on_epoch_end`` marks it.
The engine's timings are added to the Trainer's logs under ``hybrid/...`` (``on_log``).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers import TrainerCallback

from .config import rollout_batch_rows
from .engine import HybridEngine
from .weights import unwrap_training_model

_MISSING = object()


class HybridEngineCallback(TrainerCallback):
    """Trainer callback that runs ``model.generate`` through a :class:`~hf_dsinfer.HybridEngine` during training.

    Args:
        inference_config: as for :class:`~hf_dsinfer.HybridEngine` (dict, ``InferenceConfig``, JSON path or None).
        release_inference_cache, refresh, config: passed to the engine (``config``: a DeepSpeed config or its
            ``hybrid_engine`` section; with ``enabled=false`` nothing is routed and generation runs on the model).
        log_stats: add ``hybrid/refresh_ms``, ``hybrid/gather_ms``, ``hybrid/generate_ms``, ``hybrid/tokens_per_s``,
            ``hybrid/switches``, ``hybrid/train_ms`` and ``hybrid/e2e_ms`` to the Trainer's logs (means over the
            iterations since the previous log).
        config_kwargs: more config fields, or the engine's other arguments (``sampling="hf"``, ``device``).

    ``generate`` is routed from ``on_train_begin`` to ``on_train_end``; outside ``train()`` call :meth:`attach` /
    :meth:`detach` yourself. Logging integrations listed before this callback (``report_to``) do not see the
    ``hybrid/`` keys; :meth:`add_to` inserts the callback ahead of them.
    """

    def __init__(
        self,
        inference_config: Any = None,
        release_inference_cache: bool | None = None,
        refresh: str = "always",
        log_stats: bool = True,
        config: Any = None,
        **config_kwargs: Any,
    ):
        self.inference_config = inference_config
        self.engine_kwargs: dict[str, Any] = dict(
            release_inference_cache=release_inference_cache, refresh=refresh, config=config, **config_kwargs
        )
        self.log_stats = log_stats
        self.engine: HybridEngine | None = None
        # (module, attribute, its previous instance-level value or _MISSING)
        self._patched: list[tuple[nn.Module, str, Any]] = []
        self._eval_window = False  # an evaluation / prediction is about to run or running
        self._opened_by_window = False  # the engine entered inference mode for that evaluation

    # -- installing -------------------------------------------------------------------------------------------------

    def add_to(self, trainer: Any) -> HybridEngineCallback:
        """Add this callback to ``trainer`` right after its flow callback, ahead of the logging integrations."""
        callbacks = trainer.callback_handler.callbacks
        index = next((i + 1 for i, cb in enumerate(callbacks) if type(cb).__name__ == "DefaultFlowCallback"), 0)
        callbacks.insert(index, self)
        return self

    def attach(self, model: nn.Module, rollout_rows: int | None = None) -> HybridEngine:
        """Build the engine for ``model`` (once) and route ``model.generate`` through it.

        ``rollout_rows``: rows of one rollout batch; unless the inference config sets ``max_batch_size``, the static
        cache and CUDA-graph buckets are sized for it (``on_train_begin`` passes the Trainer's generation batch)."""
        if self.engine is None or self.engine.training_model is not model:
            self.detach()
            kwargs = dict(self.engine_kwargs)
            kwargs.setdefault("rollout_rows", rollout_rows)
            self.engine = HybridEngine(model, self.inference_config, **kwargs)
        if not self._patched and self.engine.enabled:
            hf_model, peft_model = unwrap_training_model(model)
            targets = [m for m in (model, peft_model, hf_model) if m is not None]
            routes = {"generate": self._routed_generate, "generate_batch": self._routed_generate_batch}
            for target in dict.fromkeys(targets):  # unique, in order
                for attr, route in routes.items():
                    self._patched.append((target, attr, target.__dict__.get(attr, _MISSING)))
                    setattr(target, attr, route)
        return self.engine

    def detach(self) -> None:
        """Give ``generate`` back to the model(s) and leave inference mode; the engine is kept for re-attaching."""
        for target, attr, previous in reversed(self._patched):
            if previous is _MISSING:
                target.__dict__.pop(attr, None)
            else:
                setattr(target, attr, previous)
        self._patched = []
        if self.engine is not None and self.engine.in_inference:
            self.engine.restore()
        self._eval_window = self._opened_by_window = False

    def _routed_generate(self, *args: Any, **kwargs: Any) -> Any:
        """Stands in for ``model.generate`` while attached."""
        return self._route("generate", args, kwargs)

    def _routed_generate_batch(self, *args: Any, **kwargs: Any) -> Any:
        """Stands in for ``model.generate_batch`` (TRL's ``use_transformers_continuous_batching``) while attached."""
        return self._route("generate_batch", args, kwargs)

    def _route(self, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        he = self.engine
        assert he is not None
        call = getattr(he, method)
        if he.in_inference:
            return call(*args, **kwargs)
        if self._eval_window:  # one refresh for the whole evaluation; on_evaluate / on_predict switch back
            he.eval()
            self._opened_by_window = True
            return call(*args, **kwargs)
        with he.inference():  # inside a training step: back to the training mode right after the call
            return call(*args, **kwargs)

    def _close_window(self) -> None:
        if self._opened_by_window and self.engine is not None and self.engine.in_inference:
            self.engine.restore()
        self._eval_window = self._opened_by_window = False

    # -- Trainer events ---------------------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("HybridEngineCallback needs the model; the Trainer passes it to callbacks")
        self.attach(model, rollout_batch_rows(args))

    def on_train_end(self, args, state, control, **kwargs):
        self.detach()

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_evaluate:
            self._eval_window = True

    def on_epoch_end(self, args, state, control, **kwargs):
        if control.should_evaluate:
            self._eval_window = True

    def on_step_begin(self, args, state, control, **kwargs):
        self._close_window()  # never train in inference mode, whatever the evaluation did

    def on_evaluate(self, args, state, control, **kwargs):
        self._close_window()

    def on_predict(self, args, state, control, **kwargs):
        self._close_window()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not self.log_stats or self.engine is None or logs is None:
            return
        extra = self.engine.stats.log_dict()
        if not extra:
            return
        # Trainer stored a copy of ``logs`` in log_history before calling us: update both.
        last = state.log_history[-1] if state.log_history else None
        if isinstance(last, dict) and all(last.get(k) == v for k, v in logs.items()):
            last.update(extra)
        logs.update(extra)
