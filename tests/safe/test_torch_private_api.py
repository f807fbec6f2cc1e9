"""What the node agent (phalanx/safe/agent.py, the one module that overrides torch's elastic agent) relies
on in torch's private API: each overridden method still exists with the parameters phalanx's override
takes, and the attributes and helpers it reaches into are still there. A torch upgrade that changes one
fails here, by name, rather than as a fault drill that no longer recovers."""

from __future__ import annotations

import inspect

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import api as mp_api
from torch.multiprocessing.spawn import ProcessContext

from phalanx.safe.agent import PhalanxAgent

# Each private method of torch's agent that PhalanxAgent overrides, and why (agent.py says more).
OVERRIDDEN = {
    "_invoke_run": "remember which signal stopped the agent",
    "_start_workers": "a cold start when /dev/shm is full; a failure's survivors are SIGKILLed, not SIGTERMed",
    "_shutdown": "SIGTERM means 'save first' to a rank: a restart or a failed run kills instead",
    "_initialize_workers": "a SIGTERM during the start; the node's health check before a restart",
    "_restart_workers": "a regroup is told from a recovery",
    "_monitor_workers": "heartbeats, hangs, crash attribution, the run directory's presence",
}


def test_every_override_of_a_private_method_is_known():
    torch_private = {name for name in dir(LocalElasticAgent) if name.startswith("_") and not name.startswith("__")}
    overrides = {name for name, value in vars(PhalanxAgent).items() if name in torch_private and callable(value)}
    assert overrides == set(OVERRIDDEN), "an override was added or removed: list it (and why) in OVERRIDDEN"


def test_the_overridden_methods_take_what_phalanx_passes():
    for name in OVERRIDDEN:
        theirs = list(inspect.signature(getattr(LocalElasticAgent, name)).parameters)
        ours = list(inspect.signature(getattr(PhalanxAgent, name)).parameters)
        assert theirs == ours, f"torch's {name}{theirs} no longer matches phalanx's {name}{ours}"


def test_the_attributes_the_agent_reaches_into_are_there():
    # The process context of the running ranks, which _start_workers wraps (close) and patches (terminate).
    assert "self._pcontext" in inspect.getsource(LocalElasticAgent)
    assert list(inspect.signature(mp_api.PContext.close).parameters) == ["self", "death_sig", "timeout"]
    # A warm start's ranks are torch.multiprocessing processes: MultiprocessContext._pc.processes.
    assert "self._pc" in inspect.getsource(mp_api.MultiprocessContext)
    assert "self.processes = processes" in inspect.getsource(ProcessContext.__init__)
    # torch's SIGTERM handler, restored around the start (agent.py, launch/local.py).
    assert callable(mp_api._terminate_process_handler)
    assert issubclass(mp_api.SignalException, Exception)
