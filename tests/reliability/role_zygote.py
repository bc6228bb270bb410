"""A launcher that imports the serving stack once and forks one ``specserve serve ROLE`` process per request.

On a small, busy machine most of a role's start-up is importing torch and
transformers (tens of seconds each). This script pays that once: it imports
everything a role needs, prints ``ready``, then for each JSON line on stdin
(``{"argv": ["serve", "target", "--port", ...], "log": "/path/to/log"}``)
forks a child that runs :func:`specserve.launch.cli.main` with ``argv`` exactly as the
``specserve`` command would, with stdout and stderr going to ``log``, and prints
the child's pid. Each child is a real, separate process (its own gRPC server,
model and Redis connections) that a test can ``kill -9``. Children are reaped
automatically (SIGCHLD ignored); the launcher exits when stdin closes.

Run by :class:`reliability_helpers.RoleLauncher`; not a test module.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback


def main() -> None:
    import torch  # noqa: F401  (imported for the children)
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import specserve.coordinator.server
    import specserve.draft.server
    import specserve.launch.cli
    import specserve.target.server

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                code = specserve.launch.cli.main(request["argv"])
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code if isinstance(code, int) else 1)
        print(pid, flush=True)


if __name__ == "__main__":
    main()
