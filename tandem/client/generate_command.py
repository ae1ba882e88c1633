"""`tandem generate`: stream one completion from a decode server to the terminal.

PROMPT goes to the model as a user message, through its chat template, as `ollama run` and `vllm chat`
do: an instruct model given a raw prompt at temperature 1 tends to ramble or stop at once. A model
without a chat template gets the raw prompt instead; `--raw` asks for plain completion explicitly.

stdout carries only the generated text (or, with --json, one JSON object per stream message), so it
can be piped; the closing summary (finish reason, usage, time to first token) and errors go to stderr.
Exit status: 0 when generation finished (stop or length), 1 on a server error or an aborted request,
2 on a usage error (as argparse), 130 when interrupted.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, TextIO

from google.protobuf import json_format

from base.auth import CredentialsError, load_auth_token
from base.settings import AUTH_TOKEN_ENV, DEFAULT_TARGET, TARGET_ENV, get_settings
from tandem.client.errors import InvalidArgument, TandemError
from tandem.client.results import FinishReason, GenerationDelta
from tandem.client.sync_client import TandemClient

STDIN_PROMPT = "-"
EXIT_FAILED = 1
EXIT_INTERRUPTED = 130
# In the server's INVALID_ARGUMENT message for chat messages sent to a model without a template (old and new).
NO_CHAT_TEMPLATE = "has no chat template"


def _int_list(text: str) -> list[int]:
    """Parse '1,2, 3' (the argparse type of the token-id flags)."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the flags of `tandem generate`."""
    parser.add_argument(
        "prompt", nargs="?", metavar="PROMPT", help=f"prompt text; {STDIN_PROMPT!r} reads it from stdin"
    )
    prompt = parser.add_argument_group("prompt")
    form = prompt.add_mutually_exclusive_group()
    form.add_argument(
        "--chat",
        action="store_true",
        help="require the chat template (default: use it when the model has one, else send PROMPT raw)",
    )
    form.add_argument(
        "--raw", action="store_true", help="send PROMPT as plain text, without the chat template"
    )
    prompt.add_argument("--system", metavar="TEXT", help="a system message before PROMPT (not with --raw)")
    prompt.add_argument(
        "--token-ids", type=_int_list, metavar="IDS", help="token ids instead of PROMPT, e.g. 1,2,3"
    )

    sampling = parser.add_argument_group("sampling (unset: the server's default)")
    sampling.add_argument("--temperature", type=float, help="0 is greedy")
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--top-k", type=int)
    sampling.add_argument("--min-p", type=float)
    sampling.add_argument("--seed", type=int, help="makes sampling reproducible")
    sampling.add_argument(
        "--logprobs", type=int, default=0, metavar="N", help="logprobs with N alternatives (see --json)"
    )

    stopping = parser.add_argument_group("stopping")
    stopping.add_argument("--max-tokens", type=int, help="tokens to generate at most")
    stopping.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)"
    )
    stopping.add_argument(
        "--stop-token-ids",
        type=_int_list,
        action="extend",
        default=[],
        metavar="IDS",
        help="stop token ids, e.g. 2,7 (repeatable)",
    )
    stopping.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")
    stopping.add_argument("--min-tokens", type=int, default=0, help="do not stop before this many tokens")

    constraint = parser.add_argument_group("structured output (at most one)").add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema", metavar="FILE", help="the answer is JSON valid against the JSON Schema in FILE"
    )
    constraint.add_argument("--json-object", action="store_true", help="the answer is a JSON object")
    constraint.add_argument("--regex", metavar="RE", help="the whole answer matches this regular expression")
    constraint.add_argument(
        "--choice", action="append", metavar="TEXT", help="the answer is exactly one of these (repeatable)"
    )
    constraint.add_argument(
        "--grammar", metavar="FILE", help="the answer is a sentence of the EBNF grammar in FILE"
    )

    scheduling = parser.add_argument_group("request")
    scheduling.add_argument(
        "--priority", type=int, default=0, help="higher runs first under the priority policy"
    )
    scheduling.add_argument("--tenant", default="", help="tenant for fair queuing")
    scheduling.add_argument("--request-id", help="id for Abort (default: chosen by the server)")
    scheduling.add_argument("--timeout", type=float, metavar="SECONDS", help="deadline of the whole stream")
    scheduling.add_argument("--json", action="store_true", help="print each stream message as one JSON line")

    connection = parser.add_argument_group("connection")
    connection.add_argument(
        "--target",
        default=get_settings().target,
        help=f"server host:port, or dns:///name:port for round-robin over replicas "
        f"(default: ${TARGET_ENV}, else {DEFAULT_TARGET})",
    )
    connection.add_argument("--tls", action="store_true", help="use TLS, trusting the system's CAs")
    connection.add_argument(
        "--ca-cert", metavar="PEM", help="CA that signed the server's certificate (implies TLS)"
    )
    connection.add_argument("--client-cert", metavar="PEM", help="this client's certificate, for mTLS")
    connection.add_argument("--client-key", metavar="PEM", help="this client's private key, for mTLS")
    connection.add_argument(
        "--tls-server-name", metavar="NAME", help="expected name in the server's certificate"
    )
    connection.add_argument(
        "--auth-token", metavar="TOKEN", help=f"bearer token (default: ${AUTH_TOKEN_ENV})"
    )
    parser.set_defaults(generate_usage_error=parser.error)


def _read_prompt(args: argparse.Namespace) -> str | None:
    return sys.stdin.read() if args.prompt == STDIN_PROMPT else args.prompt


def _prompt_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """prompt / token_ids / messages from the flags; inconsistent combinations are usage errors."""
    usage_error = args.generate_usage_error
    if args.token_ids is not None:
        if args.prompt is not None:
            usage_error("give either PROMPT or --token-ids, not both")
        if args.chat or args.system is not None:
            usage_error("--chat and --system need PROMPT text, not --token-ids")
        return {"token_ids": args.token_ids}
    if args.prompt is None:
        usage_error(f"give a PROMPT ({STDIN_PROMPT!r} reads it from stdin) or --token-ids")
    if args.system is not None and args.raw:
        usage_error("--system needs the chat template; drop --raw")
    text = _read_prompt(args)
    if args.raw:
        return {"prompt": text}
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    return {"messages": [*system, {"role": "user", "content": text}]}


def _read_file(args: argparse.Namespace, flag: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as file:
            return file.read()
    except (OSError, UnicodeDecodeError) as exc:
        args.generate_usage_error(f"{flag}: cannot read {path}: {exc}")
        raise  # not reached: usage errors exit


def _constraint_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The structured-output kwargs of the flags (the server checks the schema, regex or grammar)."""
    if args.json_schema is not None:
        return {"json_schema": _read_file(args, "--json-schema", args.json_schema)}
    if args.grammar is not None:
        return {"grammar": _read_file(args, "--grammar", args.grammar)}
    return {"json_object": args.json_object, "regex": args.regex, "choice": args.choice}


def _request_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        **_prompt_kwargs(args),
        **_constraint_kwargs(args),
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "seed": args.seed,
        "logprobs": args.logprobs,
        "max_tokens": args.max_tokens,
        "stop": args.stop,
        "stop_token_ids": args.stop_token_ids,
        "ignore_eos": args.ignore_eos,
        "min_tokens": args.min_tokens,
        "request_id": args.request_id,
        "priority": args.priority,
        "tenant": args.tenant,
        "timeout": args.timeout,
    }


def _json_line(delta: GenerationDelta) -> str:
    return json.dumps(json_format.MessageToDict(delta.raw), ensure_ascii=False, separators=(",", ":"))


def _summary(final: GenerationDelta, time_to_first_token: float | None) -> str:
    """One stderr line: why it stopped, token counts, client-side and server-side time to first token."""
    finish = final.finish_reason.value if final.finish_reason else "unknown"
    if final.matched_stop is not None:
        finish += f" (matched {final.matched_stop!r})"
    parts = [f"finish: {finish}"]
    if final.usage is not None:
        usage = final.usage
        parts.append(f"usage: {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens")
    if time_to_first_token is not None:
        ttft = f"ttft: {time_to_first_token:.3f} s"
        if final.timings is not None:
            ttft += f" (server {final.timings.first_token_seconds:.3f} s)"
        parts.append(ttft)
    return " | ".join(parts)


def _stream(client: TandemClient, kwargs: dict[str, Any], as_json: bool, out: TextIO, err: TextIO) -> int:
    start = time.monotonic()
    time_to_first_token: float | None = None
    final: GenerationDelta | None = None
    wrote_text = False
    try:
        for delta in client.generate(**kwargs):
            if time_to_first_token is None and delta.token_ids:
                time_to_first_token = time.monotonic() - start
            out.write(_json_line(delta) + "\n" if as_json else delta.text)
            out.flush()
            wrote_text = wrote_text or bool(delta.text)
            if delta.is_final:
                final = delta
    finally:
        if wrote_text and not as_json:
            # End the text's line, even when an error cuts the stream short.
            out.write("\n")
            out.flush()
    if final is None:
        print("error: the stream ended without a final message", file=err)
        return EXIT_FAILED
    print(_summary(final, time_to_first_token), file=err)
    return EXIT_FAILED if final.finish_reason is FinishReason.ABORT else 0


def _may_fall_back_to_raw(args: argparse.Namespace, error: InvalidArgument) -> bool:
    """The default chat form was refused for want of a template: retry with the raw prompt (the refusal
    comes before any output, so nothing was printed twice)."""
    implicit_chat = not (args.chat or args.raw or args.token_ids is not None or args.system is not None)
    return implicit_chat and NO_CHAT_TEMPLATE in str(error)


def run(args: argparse.Namespace) -> int:
    """Send the request and stream the answer; returns the exit status."""
    kwargs = _request_kwargs(args)
    try:
        client = TandemClient(
            args.target,
            tls=args.tls,
            ca_cert=args.ca_cert,
            client_cert=args.client_cert,
            client_key=args.client_key,
            tls_server_name=args.tls_server_name,
            auth_token=args.auth_token or load_auth_token(),
        )
    except CredentialsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    with client:
        try:
            try:
                return _stream(client, kwargs, args.json, sys.stdout, sys.stderr)
            except InvalidArgument as exc:
                if not _may_fall_back_to_raw(args, exc):
                    raise
                print("note: the model has no chat template; sending the prompt raw", file=sys.stderr)
                raw = dict(kwargs)
                raw["prompt"] = raw.pop("messages")[-1]["content"]
                return _stream(client, raw, args.json, sys.stdout, sys.stderr)
        except TandemError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_FAILED
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
