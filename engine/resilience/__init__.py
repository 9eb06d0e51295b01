"""What keeps a run's work safe when something goes wrong.

- ``watchdog``: a frozen peer (no progress within ``trainer.collective_timeout_s``) stops
  every rank with one line naming the step, the rank and the group it waits on;
- ``guard``: bad steps (non-finite loss or gradients, fp16 overflow) are skipped, never
  checkpointed, and stop the run after ``trainer.max_bad_steps`` in a row;
- ``preemption``: SIGTERM, SIGUSR1 and Ctrl-C stop every rank after the same step, with a
  checkpoint, and exit 75;
- ``elastic_report``: one line per worker restart instead of torch's traceback.
"""
