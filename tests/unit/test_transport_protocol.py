"""Every weight transport's ends satisfy the one protocol (chatgen.param_sync.checks: Sender, Receiver):
the same method names, parameter names, kinds and defaults, read from the classes themselves.

    pytest tests/unit/test_transport_protocol.py
"""

import inspect

import pytest

from chatgen.param_sync import (
    AdapterSender,
    GroupReceiver,
    GroupSender,
    LocalSender,
    Receiver,
    Sender,
    ShmReceiver,
    ShmSender,
)


def shape(fn) -> list:
    """(name, kind, has a default) of each parameter: what a caller of the protocol relies on."""
    return [
        (p.name, p.kind, p.default is not inspect.Parameter.empty)
        for p in inspect.signature(fn).parameters.values()
    ]


@pytest.mark.parametrize("cls", [GroupReceiver, ShmReceiver])
def test_both_receivers_take_the_protocols_receive_into(cls):
    assert shape(cls.receive_into) == shape(Receiver.receive_into)
    assert callable(cls.close)


@pytest.mark.parametrize("cls", [LocalSender, GroupSender, ShmSender, AdapterSender])
def test_every_sender_takes_the_protocols_send(cls):
    assert shape(cls.send) == shape(Sender.send)


def test_a_receiver_without_the_method_is_not_one():
    class Partial:
        def close(self):
            pass

    assert not isinstance(Partial(), Receiver)
