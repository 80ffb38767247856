# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""`vllm kv-transfer-config`: print one role's --kv-transfer-config JSON."""

import argparse
import json
import sys
import typing
from typing import Any

from vllm.distributed.kv_transfer.role_chains import (
    OFF,
    Deployment,
    MooncakeClient,
    OffloadOverride,
    RoleConfig,
    RoleConfigError,
    build_role_config,
    parse_offload,
)
from vllm.entrypoints.cli.types import CLISubcommand

if typing.TYPE_CHECKING:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
else:
    FlexibleArgumentParser = argparse.ArgumentParser

DESCRIPTION = """\
Print the exact --kv-transfer-config JSON for one role of a deployment.
The usage line above lists every option; the groups below explain them.

Describe the whole deployment (the same flags on every role's node) and pick
the role with --role; the JSON goes to stdout, a one-line summary to stderr:

  vllm serve MODEL --kv-transfer-config "$(vllm kv-transfer-config \\
      --role decode --offload mooncake:64GiB --decode-offload mooncake:0)"

Under P/D (--role prefill or decode) NixlConnector comes first; a single
connector is printed bare, several are wrapped in a MultiConnector. Offload
sizes take binary units (0, 512MiB, 64GiB; GB means GiB, as Mooncake reads
it). Roles using the Mooncake store also need MOONCAKE_CONFIG_PATH: print that
file with --emit mooncake-config.
"""

EPILOG = """\
Every option in full:      vllm kv-transfer-config --help=all
One group:                 vllm kv-transfer-config --help=deployment
One option:                vllm kv-transfer-config --help=offload
"""

# The groups vLLM's --help lists (title: first line of the description).
DEPLOYMENT_GROUP = (
    "deployment",
    (
        "The role and the deployment it belongs to: --role, --offload, "
        "--prefill-offload, --decode-offload, --save-decode-cache, "
        "--hisparse-host-pool-gib, --nixl-threads, --routed-experts-transfer."
    ),
)
OUTPUT_GROUP = ("output", "What to print: --emit.")
MOONCAKE_GROUP = (
    "mooncake-client",
    (
        "Where a Mooncake role's store client connects (used with --emit "
        "mooncake-config / all): --mooncake-master, --mooncake-metadata-server, "
        "--mooncake-protocol, --mooncake-device, --mooncake-local-buffer."
    ),
)


def _offload(option: str) -> typing.Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return parse_offload(text, option)
        except RoleConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return parse


def _override(option: str) -> typing.Callable[[str], OffloadOverride]:
    parse = _offload(option)

    def parse_override(text: str) -> OffloadOverride:
        return None if text.strip().lower() == "inherit" else parse(text)

    return parse_override


def deployment_from_args(args: argparse.Namespace) -> Deployment:
    shared = args.offload
    return Deployment(
        pd=args.role != "colocated",
        offload=None if shared == OFF else shared,
        prefill_offload=args.prefill_offload,
        decode_offload=args.decode_offload,
        save_decode_cache=args.save_decode_cache,
        hisparse_host_pool_gib=args.hisparse_host_pool_gib,
        nixl_num_threads=args.nixl_threads,
        routed_experts_transfer=args.routed_experts_transfer,
    )


def render(config: RoleConfig, emit: str) -> str:
    """The text --emit asks for."""
    if emit == "kv-transfer-config":
        return json.dumps(config.kv_transfer_config, separators=(",", ":"))
    if emit == "mooncake-config":
        if config.mooncake_config is None:
            raise RoleConfigError(
                f"--emit mooncake-config: the {config.role} role does not use "
                "the Mooncake store, so it needs no MOONCAKE_CONFIG_PATH"
            )
        return json.dumps(config.mooncake_config, indent=2)
    return json.dumps(
        {
            "role": config.role,
            "kv_transfer_config": config.kv_transfer_config,
            "mooncake_config": config.mooncake_config,
        },
        indent=2,
    )


class KVTransferConfigSubcommand(CLISubcommand):
    """The `kv-transfer-config` subcommand for the vLLM CLI."""

    name = "kv-transfer-config"

    @staticmethod
    def cmd(args: argparse.Namespace) -> None:
        client = MooncakeClient(
            master_server_address=args.mooncake_master,
            metadata_server=args.mooncake_metadata_server,
            protocol=args.mooncake_protocol,
            device_name=args.mooncake_device,
            local_buffer_size=args.mooncake_local_buffer,
        )
        try:
            config = build_role_config(deployment_from_args(args), args.role, client)
            text = render(config, args.emit)
        except RoleConfigError as exc:
            print(f"vllm kv-transfer-config: error: {exc}", file=sys.stderr)
            sys.exit(2)
        print(text)
        print(f"kv-transfer-config: {config.summary}", file=sys.stderr)
        if args.routed_experts_transfer and args.role != "colocated":
            print(
                "kv-transfer-config: rows travel with the KV only when both roles "
                "are built with --routed-experts-transfer and served with "
                "--enable-return-routed-experts",
                file=sys.stderr,
            )
        if config.mooncake_config is not None and args.emit == "kv-transfer-config":
            print(
                "kv-transfer-config: this role uses the Mooncake store; point "
                "MOONCAKE_CONFIG_PATH at the output of --emit mooncake-config",
                file=sys.stderr,
            )

    def subparser_init(
        self, subparsers: argparse._SubParsersAction
    ) -> FlexibleArgumentParser:
        parser = subparsers.add_parser(
            self.name,
            help="Print the --kv-transfer-config JSON for one deployment role.",
            description=DESCRIPTION,
            epilog=EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_deployment_arguments(parser.add_argument_group(*DEPLOYMENT_GROUP))
        add_output_arguments(parser.add_argument_group(*OUTPUT_GROUP))
        add_mooncake_client_arguments(parser.add_argument_group(*MOONCAKE_GROUP))
        return parser


def add_deployment_arguments(group: argparse._ArgumentGroup) -> None:
    """--role and the options that describe the deployment."""
    group.add_argument(
        "--role",
        required=True,
        choices=["prefill", "decode", "colocated"],
        help="Which instance the JSON is for. prefill and decode are the "
        "two roles of a NIXL P/D deployment; colocated is a single "
        "instance that prefills and decodes.",
    )
    group.add_argument(
        "--offload",
        type=_offload("--offload"),
        default=OFF,
        metavar="SPEC",
        help="KV offload shared by every role: off (default), "
        "native:<bytes> (vLLM's OffloadingConnector with a CPU tier of that "
        "size) or mooncake:<segment bytes> (MooncakeStoreConnector; the "
        "segment is the memory this role adds to the store, 0 to add none).",
    )
    for role in ("prefill", "decode"):
        group.add_argument(
            f"--{role}-offload",
            type=_override(f"--{role}-offload"),
            default=None,
            metavar="SPEC",
            help=f"The {role} role's own offload, overriding --offload: "
            "inherit (default), off (none for this role even when --offload "
            "is set), native:<bytes> or mooncake:<segment bytes>.",
        )
    group.add_argument(
        "--save-decode-cache",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Have the decode role's Mooncake child store decode-phase KV, "
        "so the next turn's prefill can load it. Default: on when a P/D "
        "decode role uses the Mooncake store, off otherwise.",
    )
    group.add_argument(
        "--hisparse-host-pool-gib",
        type=float,
        default=None,
        metavar="GIB",
        help="Add HiSparseConnector with this host pool (GiB) to the decode "
        "role (--role decode only: the builder offers HiSparse on a P/D decode "
        "instance, the mode the reference deployment runs with). Before "
        "printing, the decode chain goes through the HiSparse chain check "
        "vllm serve runs at startup; the DSA model (index_topk) and CUDA are "
        "checked when vllm serve starts.",
    )
    group.add_argument(
        "--nixl-threads",
        type=int,
        default=1,
        metavar="N",
        help="NixlConnector num_threads (P/D roles). Default: 1.",
    )
    group.add_argument(
        "--routed-experts-transfer",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="Routed-experts rows travel with the KV "
        "(enable_routed_experts_transfer). P/D roles: over NIXL, so decode's "
        "response holds every row and any P/D router returns complete rows; "
        "build both roles with it. An --offload (native or mooncake): each "
        "offloaded chunk carries its rows, so loads reach positions whose rows "
        "are returned (P/D and colocated roles). Serve with "
        "--enable-return-routed-experts. "
        "Default: off (prefill and decode each return their part of the rows; "
        "offload loads stop where rows are needed).",
    )


def add_output_arguments(group: argparse._ArgumentGroup) -> None:
    """--emit."""
    group.add_argument(
        "--emit",
        choices=["kv-transfer-config", "mooncake-config", "all"],
        default="kv-transfer-config",
        help="kv-transfer-config (default): the compact JSON for "
        "--kv-transfer-config. mooncake-config: the file MOONCAKE_CONFIG_PATH "
        "must name on this role (Mooncake roles only). all: both, as one "
        "JSON object, for review.",
    )


def add_mooncake_client_arguments(group: argparse._ArgumentGroup) -> None:
    """The Mooncake store client settings (--mooncake-*)."""
    group.add_argument(
        "--mooncake-master",
        default=MooncakeClient.master_server_address,
        metavar="HOST:PORT",
        help="The mooncake_master RPC address. Default: %(default)s.",
    )
    group.add_argument(
        "--mooncake-metadata-server",
        default=MooncakeClient.metadata_server,
        metavar="URL",
        help="The transfer-engine metadata server. Default: %(default)s.",
    )
    group.add_argument(
        "--mooncake-protocol",
        default=MooncakeClient.protocol,
        choices=["rdma", "tcp"],
        help="Transfer protocol. Default: %(default)s.",
    )
    group.add_argument(
        "--mooncake-device",
        default=MooncakeClient.device_name,
        metavar="NAME",
        help="RDMA device names (empty: Mooncake picks).",
    )
    group.add_argument(
        "--mooncake-local-buffer",
        default=None,
        metavar="SIZE",
        help="The client's local transfer buffer (e.g. 1GB). Default: vLLM's default.",
    )


def cmd_init() -> list[CLISubcommand]:
    return [KVTransferConfigSubcommand()]
