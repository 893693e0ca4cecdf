"""Wall-clock timers patched around methods: where a runtime step's host time goes."""
import collections
import functools
import time

acc = collections.Counter()   # "Class.method" -> seconds since the last clear()


def timed(cls, name):
    fn = getattr(cls, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[f"{cls.__name__}.{name}"] += time.perf_counter() - start
    setattr(cls, name, wrapper)
