"""The peers' own test scenarios on chatgen's facades (tests/peers/): coroutine tests run with asyncio.run
(NeMo RL's are `@pytest.mark.asyncio`; the suite has no asyncio plugin)."""

import asyncio
import inspect

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "asyncio: a coroutine test, run with asyncio.run")


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    if inspect.iscoroutinefunction(pyfuncitem.obj):
        names = pyfuncitem._fixtureinfo.argnames
        asyncio.run(pyfuncitem.obj(**{name: pyfuncitem.funcargs[name] for name in names}))
        return True
    return None
