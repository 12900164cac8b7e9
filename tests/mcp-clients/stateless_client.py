"""An MCP client for the stateless revision (2026-07-28) on the official Python
SDK (`mcp`, its high-level `mcp.Client`), driven by ctxsync's tests; the same
scenario and output as stateless_client.mjs.

python stateless_client.py --url URL --key KEY --call NAME [--arguments JSON]
  [--handle H] [--listen-seconds N [--change-file PATH --change-to TEXT]]
  [--call-after NAME]

Connects with `mode="auto"` (probes `server/discover`, speaks 2026-07-28
statelessly, falls back to the initialize handshake on an older server) and
the tenant key as a bearer token, with the client's response cache disabled
so every list reaches the server. Lists every tool (following nextCursor),
keeping the first page's cache hints (`ttlMs`, `cacheScope`, `_meta`), and
calls --call. Every request carries `_meta: {"ctxsync.dev/pins": H}` (--handle,
else the handle the first list page answered, once known). With
--listen-seconds it then opens `subscriptions/listen` for tool list changes,
writes --change-to to --change-file once the listen is acknowledged, and
reports whether `notifications/tools/list_changed` arrived in time (on a
pre-2026 connection, which has no listen, it waits for the unsolicited
notification instead and says so on stderr). With --call-after it lists again
and calls that tool.
Prints one JSON object on stdout; exits 0 unless the client itself failed.
"""

import argparse
import asyncio
import json
import sys

import anyio
import mcp_types as types
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.client.subscriptions import ListenNotSupportedError, SubscriptionLost, ToolsListChanged
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError

DEADLINE_SECONDS = 120
PINS_META = "ctxsync.dev/pins"


def note(message):
    print(f"stateless_client.py: {message}", file=sys.stderr, flush=True)


def result_json(result):
    return {
        "is_error": bool(result.is_error),
        "content": [c.model_dump(mode="json", by_alias=True, exclude_none=True) for c in result.content],
        "structured": result.structured_content,
    }


class Conversation:
    """The client and the pin handle its requests carry."""

    def __init__(self, client, handle):
        self.client = client
        self.handle = handle

    def meta(self):
        return {PINS_META: self.handle} if self.handle is not None else None

    async def list_tools(self):
        """Every tool's name, and the first page's hints."""
        names, hints, cursor = [], None, None
        while True:
            page = await self.client.list_tools(cursor=cursor, meta=self.meta())
            if hints is None:
                # Parsed results default ttl_ms=0 / cache_scope="private", so
                # only the fields the server actually sent count as hints.
                sent = page.model_fields_set
                hints = {
                    "ttlMs": page.ttl_ms if "ttl_ms" in sent else None,
                    "cacheScope": page.cache_scope if "cache_scope" in sent else None,
                    "meta": page.meta,
                }
                if self.handle is None and page.meta and PINS_META in page.meta:
                    self.handle = page.meta[PINS_META]
            names.extend(tool.name for tool in page.tools)
            cursor = page.next_cursor
            if not cursor:
                return names, hints

    async def call(self, name, arguments):
        return result_json(await self.client.call_tool(name, arguments, meta=self.meta()))

    def carry_pins_on_listen(self):
        """`Client.listen()` takes no `_meta`: add the handle to the listen
        request where the session stamps every request's `_meta` (private)."""
        session = self.client.session
        stamp = session._stamp

        def stamp_with_pins(data, opts):
            stamp(data, opts)
            if data["method"] == "subscriptions/listen" and self.handle is not None:
                data.setdefault("params", {}).setdefault("_meta", {})[PINS_META] = self.handle

        session._stamp = stamp_with_pins


def change(args):
    """Write --change-to to --change-file, once."""
    if args.change_file and not getattr(args, "changed", False):
        with open(args.change_file, "w") as f:
            f.write(args.change_to)
        args.changed = True


async def listen_for_change(conversation, args, unsolicited):
    """Whether notifications/tools/list_changed arrived within --listen-seconds."""
    client = conversation.client
    try:
        async with client.listen(tools_list_changed=True) as subscription:
            if not subscription.honored.tools_list_changed:
                note("the server acknowledged the listen without tools list changes")
            change(args)
            with anyio.move_on_after(args.listen_seconds):
                async for event in subscription:
                    if isinstance(event, ToolsListChanged):
                        return True
                note("the server closed the listen stream")
            return False
    except ListenNotSupportedError:
        note(
            f"subscriptions/listen needs 2026-07-28, the connection negotiated {client.protocol_version}; "
            "waiting for an unsolicited notifications/tools/list_changed instead"
        )
        change(args)
        with anyio.move_on_after(args.listen_seconds):
            await unsolicited.wait()
            return True
        return False
    except MCPError as error:
        note(f"the server refused subscriptions/listen: error {error.code}: {error}")
        change(args)
        return False
    except SubscriptionLost as error:
        note(f"subscriptions/listen failed: {error}")
        change(args)
        return False


async def run(args):
    out = {}
    unsolicited = asyncio.Event()

    async def on_message(message):
        if isinstance(message, types.ToolListChangedNotification):
            unsolicited.set()
        elif isinstance(message, Exception):
            note(f"transport: {message!r}")

    headers = {"Authorization": f"Bearer {args.key}"}
    async with create_mcp_http_client(headers=headers) as http:
        transport = streamable_http_client(args.url, http_client=http)
        async with Client(transport, mode="auto", cache=None, message_handler=on_message) as client:
            conversation = Conversation(client, args.handle)
            conversation.carry_pins_on_listen()
            out["protocol"] = client.protocol_version
            out["tools"], out["list_hints"] = await conversation.list_tools()
            tool_arguments = json.loads(args.arguments)
            out["first_call"] = await conversation.call(args.call, tool_arguments)
            if args.listen_seconds is not None:
                out["list_changed"] = await listen_for_change(conversation, args, unsolicited)
            if args.call_after:
                out["tools_after"], _ = await conversation.list_tools()
                out["second_call"] = await conversation.call(args.call_after, tool_arguments)
    print(json.dumps(out))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--call", required=True)
    parser.add_argument("--arguments", default="{}")
    parser.add_argument("--handle")
    parser.add_argument("--listen-seconds", type=float)
    parser.add_argument("--change-file")
    parser.add_argument("--change-to", default="[]")
    parser.add_argument("--call-after")
    args = parser.parse_args()
    asyncio.run(asyncio.wait_for(run(args), DEADLINE_SECONDS))


if __name__ == "__main__":
    sys.exit(main())
