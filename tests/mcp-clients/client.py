"""An MCP client on the official Python SDK (`mcp`), driven by ctxsync's tests.

Connects to a streamable-HTTP MCP endpoint with a tenant key, lists every
tool (following nextCursor), optionally calls a tool; with --prompt it lists
every prompt and resource, gets that prompt and reads --read; with --change-file it
then rewrites that file (the fixture server's tools file), waits for
notifications/tools/list_changed, lists again and calls --call-after.
Prints one JSON object on stdout; exits 0 unless the client itself failed.
"""

import argparse
import asyncio
import json
import sys
import time

import mcp.types as types
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

DEADLINE_SECONDS = 30


def result_json(result):
    return {
        "is_error": bool(result.is_error),
        "content": [c.model_dump(mode="json", exclude_none=True) for c in result.content],
        "structured": result.structured_content,
    }


async def list_all(session, method="list_tools", field="tools", key="name"):
    names, cursor = [], None
    while True:
        params = types.PaginatedRequestParams(cursor=cursor) if cursor else None
        page = await getattr(session, method)(params=params)
        names.extend(str(getattr(item, key)) for item in getattr(page, field))
        cursor = page.next_cursor
        if not cursor:
            return names


async def run(args):
    out = {}
    changed = asyncio.Event()

    async def on_message(message):
        if isinstance(message, types.ToolListChangedNotification):
            changed.set()

    headers = {"Authorization": f"Bearer {args.key}"}
    started = time.monotonic()
    async with create_mcp_http_client(headers=headers) as http:
        async with streamable_http_client(args.url, http_client=http) as (read, write):
            async with ClientSession(read, write, message_handler=on_message) as session:
                init = await session.initialize()
                out["protocol"] = str(init.protocol_version)
                out["tools"] = await list_all(session)
                out["connect_to_list_ms"] = (time.monotonic() - started) * 1000
                if args.prompt:
                    out["prompts"] = await list_all(session, "list_prompts", "prompts")
                    out["resources"] = await list_all(session, "list_resources", "resources", "uri")
                    prompt = await session.get_prompt(args.prompt)
                    out["prompt_text"] = prompt.messages[0].content.text
                    read = await session.read_resource(args.read)
                    out["read_uri"] = str(read.contents[0].uri)
                if args.call:
                    result = await session.call_tool(args.call, json.loads(args.arguments))
                    out["first_call"] = result_json(result)
                if args.change_file:
                    with open(args.change_file, "w") as f:
                        f.write(args.change_to)
                    try:
                        await asyncio.wait_for(changed.wait(), DEADLINE_SECONDS)
                        out["list_changed"] = True
                    except asyncio.TimeoutError:
                        out["list_changed"] = False
                    out["tools_after"] = await list_all(session)
                    result = await session.call_tool(args.call_after, json.loads(args.arguments))
                    out["second_call"] = result_json(result)
    print(json.dumps(out))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--call")
    parser.add_argument("--arguments", default="{}")
    parser.add_argument("--change-file")
    parser.add_argument("--change-to", default="[]")
    parser.add_argument("--call-after")
    parser.add_argument("--prompt")
    parser.add_argument("--read")
    args = parser.parse_args()
    asyncio.run(asyncio.wait_for(run(args), 120))


if __name__ == "__main__":
    sys.exit(main())
