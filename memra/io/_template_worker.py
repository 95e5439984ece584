"""Child process that renders chat templates under hard limits (see
:func:`memra.io.chat_template.render_chat_template_bounded`).

Protocol over stdin/stdout: each request and each reply is a 4-byte little-endian length
followed by a pickle. A request is ``(template, messages, kwargs, max_output_chars)``; a
reply is ``("ok", text)``, ``("err", exception)`` or ``("fatal", exception)`` (after which the
process exits); a ``("ready", None)`` message is sent once at start. At start the process caps its address
space (``RLIMIT_AS``) at ``argv[1]`` bytes, so a template that builds a huge string gets a
``MemoryError`` here instead of taking the parent down; the parent bounds wall time by
killing this process.
"""

from __future__ import annotations

import pickle
import resource
import struct
import sys


def _read(f) -> bytes | None:
    head = f.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack("<I", head)
    return f.read(n)


def _write(f, obj) -> None:
    data = pickle.dumps(obj)
    f.write(struct.pack("<I", len(data)) + data)
    f.flush()


def main() -> None:
    limit = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from memra.io.chat_template import ChatTemplateError, ChatTemplateLimitError, render_chat_template

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    _write(out, ("ready", None))  # the parent starts a render's clock only after this
    while True:
        req = _read(inp)
        if req is None:
            return
        try:
            template, messages, kwargs, max_chars = pickle.loads(req)
            text = render_chat_template(template, messages, max_output_chars=max_chars, **kwargs)
            _write(out, ("ok", text))
        except MemoryError:
            # the heap may stay near the cap: answer, then exit so the parent starts a fresh worker
            _write(out, ("fatal", ChatTemplateLimitError(
                f"chat template rendering exceeded the memory limit of {limit >> 20} MiB")))
            return
        except ChatTemplateError as e:
            _write(out, ("err", e))
        except Exception as e:  # anything else is still the template's (or its input's) fault
            _write(out, ("err", ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}")))


if __name__ == "__main__":
    main()
