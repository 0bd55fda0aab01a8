"""What one training run keeps besides its components: the settings of the ``trainer``, ``logging`` and
``checkpoint`` sections (:mod:`.config`), the metric sinks and console line (:mod:`.metrics`), the plots of a
run's ``metrics.jsonl`` (:mod:`.plots`), the lock that keeps a second run out of its directory (:mod:`.lock`),
the stop on a signal (:mod:`.preemption`) and the checks of a batch around the update (:mod:`.batch_checks`,
:mod:`.stale_engine`)."""
