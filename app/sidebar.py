"""The sidebar: model source, prompt and Trace button, block selector. It decides which trace the
session shows; messages (errors, progress) go to the ``notices`` container at the top of the page."""

from __future__ import annotations

import math
from pathlib import Path

import streamlit as st

from tracing.errors import InputError
from tracing.nonfinite import first_nonfinite
from tracing.sampling import Sampling

from .core import paths, settings
from .core.errors import BAD_INPUT
from .core.markup import code_md, escape_md
from .core.models import AppModel, open_by_key, open_model, open_server
from .core.session import SOURCES, current_entry, name_upload, origin
from .core.traces import Chat, Generation, TraceKey, chat_refusal, open_upload, store, token_limit, trace_prompt
from .ui.progress import progress, stopped_notice

SOURCE_LABELS = {"demo": "Bundled demo", "dir": "Checkpoint directory", "server": "Model server", "upload": "Trace file"}


def _source_label(value: str) -> str:
    default = settings.default_checkpoint()
    if value == "demo" and default != "demo":
        return f"Default checkpoint ({Path(default).name})"
    return SOURCE_LABELS[value]


def render(notices) -> None:
    """Draw the sidebar, run what it asks for, and leave the session's trace key set (or None)."""
    with st.sidebar:
        st.markdown("#### Model")
        source = st.radio(
            "Model source",
            SOURCES,
            key="source",
            format_func=_source_label,
            help="The bundled demo is a tiny trained DeepSeek-V3.2 with every mechanism of the real one. "
            "A trace file (.safetensors from `python -m tracing run`) opens without any model.",
        )
        om = None
        if source in ("demo", "dir"):
            om = _model_source(source, notices)
        elif source == "server":
            om = _server_source(notices)
        else:
            _upload_source(notices)

        if source != "upload":
            st.markdown("#### Prompt")
            st.text_area(
                "Prompt",
                key="prompt",
                height=110,
                max_chars=20_000,
                disabled=om is None,
                label_visibility="collapsed",
                help=f"Up to {settings.max_tokens() if om is None else token_limit(om):,} tokens.",
            )
            _chat_control(om)
            _generate_control(om)
            if source != "server":  # a server's model runs as it was started
                with st.expander("Run options"):
                    st.radio(
                        "Activation dtype",
                        settings.DTYPES,
                        key="dtype",
                        horizontal=True,
                        help="bfloat16 as the reference; float32 shows the same computation without its rounding",
                    )
            run = st.button("Trace", type="primary", disabled=om is None, width="stretch", key="run")
            if om is not None:
                _trace(om, run, notices)
        _ensure_current(om, notices)
        _nonfinite_notice(notices)
        _block_selector()


def _model_source(source: str, notices):
    value = (
        settings.default_checkpoint()
        if source == "demo"
        else st.text_input(
            "Checkpoint directory",
            key="ckpt_dir",
            placeholder="/data/DeepSeek-V3.2-Exp",
            help="A Hugging Face layout directory: config.json, model.safetensors.index.json and shards "
            "(or one model.safetensors), tokenizer.json" + paths.roots_help("checkpoints"),
        )
    )
    if source == "dir" and not value.strip():
        st.caption("Type the path of a checkpoint directory and press Enter.")
        return None
    try:
        om = open_model(value, st.session_state["dtype"])
    except BAD_INPUT as exc:
        notices.error(f"**Checkpoint not loaded.** {escape_md(str(exc))}", icon=":material/error:")
        return None
    return _described(om)


def _server_source(notices):
    """A model server (python -m tracing serve): its URL, its model and ranks."""
    locked = settings.checkpoint_roots() is not None  # a shared deployment reaches only the server it names
    if locked:
        st.session_state["server_url"] = settings.server_url()
    value = st.text_input(
        "Model server",
        key="server_url",
        placeholder="http://127.0.0.1:8600",
        disabled=locked,
        help="The URL `python -m tracing serve` prints (ANATOMY_SERVER sets the default; ANATOMY_SERVER_TOKEN_FILE "
        "its token). The model stays loaded there, over the ranks of a node if torchrun started it.",
    )
    if not value.strip():
        st.caption("Type the URL of a model server and press Enter.")
        return None
    try:
        om = open_server(value)
    except BAD_INPUT as exc:
        notices.error(f"**Model server not reached.** {escape_md(str(exc))}", icon=":material/error:")
        return None
    return _described(om)


def _described(om):
    """Say which model the sidebar holds, and how it computes, under its source."""
    first, *rest = om.describe()
    lines = [escape_md(first), *(f":material/memory: {escape_md(line)}" for line in rest)]
    lines += [f":material/info: {escape_md(note)}" for note in om.notes]
    st.caption("  \n".join(lines))  # one element: each one more costs the browser a redraw on every rerun
    return om


def _upload_source(notices) -> None:
    server_mb = st.get_option("server.maxUploadSize")
    upload = st.file_uploader(
        "Trace file",
        type=["safetensors"],
        key="upload",
        max_upload_size=max(1, min(server_mb, math.ceil(settings.max_upload_bytes() / 2**20))),
        help="A trace written by `python -m tracing run ... --out trace.safetensors` or downloaded from the Export page.",
    )
    if upload is None:
        st.caption(
            "Drop a trace file here: it is read as data only (never unpickled) and needs no model. "
            "Until then the pages show the last trace."
        )
        return
    try:
        entry = open_upload(upload.getvalue(), upload.name)
    except BAD_INPUT as exc:
        notices.error(f"**Trace file not opened.** {escape_md(str(exc))}", icon=":material/error:")
        return
    name_upload(entry, upload.name)
    st.session_state["trace_key"] = entry.key


def _chat_control(om: AppModel | None) -> None:
    """Frame the prompt as a user turn of DeepSeek-V3.2's conversation format, so the model answers it."""
    refusal = None if om is None else chat_refusal(om)
    if refusal is not None:
        st.session_state["chat"] = False  # a setting carried from another checkpoint: this one cannot hold a chat
    st.toggle(
        "Chat turn",
        key="chat",
        disabled=om is None or refusal is not None,
        help="The prompt as a user turn of DeepSeek-V3.2's conversation format: begin-of-sentence, User, the prompt, "
        "Assistant, then the thinking marker. Generate tokens to watch the model answer.",
    )
    if st.session_state.get("chat"):
        st.toggle(
            "Thinking",
            key="chat_thinking",
            help="On: the answer starts with `<think>` and the model reasons first. Off: `</think>`, it answers at once.",
        )
    if refusal is not None:
        st.caption(
            f":material/chat_error: Chat turns need DeepSeek-V3.2's vocabulary (its User, Assistant and think markers): "
            f"{escape_md(refusal)}."
        )


def chat_request() -> Chat | None:
    """The chat framing the sidebar asks for (None: the prompt as typed)."""
    return Chat(bool(st.session_state.get("chat_thinking"))) if st.session_state.get("chat") else None


def _generate_control(om: AppModel | None) -> None:
    """How many tokens the model writes after the prompt, and how it picks them."""
    limit = settings.max_tokens() if om is None else token_limit(om)
    row = st.container(horizontal=True)  # one flex row: two columns would be three elements
    row.number_input(
        "Generate",
        min_value=0,
        max_value=limit,
        step=1,
        key="gen_tokens",
        disabled=om is None,
        help="New tokens the model writes after the prompt, each fed back through the decode path "
        f"(0: trace the prompt alone). Prompt and new tokens together: at most {limit}.",
    )
    row.radio("Choice", ("greedy", "sampled"), key="gen_mode", disabled=om is None, help="Greedy: the most likely token.")
    if st.session_state.get("gen_mode") == "sampled":
        row = st.container(horizontal=True)
        row.number_input("Temperature", step=0.1, format="%.2f", key="gen_temperature", help="above 0")
        row.number_input("Top-p", step=0.05, format="%.2f", key="gen_top_p", help="in (0, 1]")
        row.number_input("Seed", min_value=0, step=1, key="gen_seed", placeholder="random", help="blank: a new draw")


def generation_request() -> Generation | None:
    """The generation the sidebar asks for (None: the prompt alone), or InputError saying which value is wrong."""
    return Generation.of(*_generation_settings())


def _generation_settings() -> tuple[int, Sampling]:
    """The new tokens and how to choose them, as the widgets say (a sampled seed not drawn yet)."""
    tokens = int(st.session_state.get("gen_tokens") or 0)
    if st.session_state.get("gen_mode") != "sampled":
        return tokens, Sampling()
    temperature = st.session_state.get("gen_temperature")
    top_p = st.session_state.get("gen_top_p")
    if temperature is None or not temperature > 0:
        raise InputError(f"Sampling needs a temperature above 0, not {temperature} (choose greedy for the most likely token).")
    if top_p is None or not 0 < top_p <= 1:
        raise InputError(f"Top-p must be above 0 and at most 1, not {top_p}.")
    seed = st.session_state.get("gen_seed")
    return tokens, Sampling(float(temperature), float(top_p), None if seed is None else int(seed))


def _trace(om: AppModel, run: bool, notices) -> None:
    """Trace on the button, on first load, and when the model changed under the shown trace."""
    key = st.session_state.get("trace_key")
    kept = "The pages show the last trace." if key is not None else "No trace yet."
    if not run and stopped_notice(notices, "trace", f"{kept} Press **Trace** to trace again."):
        return
    if not run and key is not None and key.on(om):
        return
    prompt = st.session_state.get("prompt", "")
    try:
        generation = generation_request()
    except InputError as exc:
        notices.error(f"**Not traced.** {escape_md(str(exc))}", icon=":material/error:")
        return
    chat = chat_request()
    wanted = TraceKey.for_prompt(om, prompt, generation=generation, chat=chat)
    if store().get(wanted) is not None:
        st.session_state["trace_key"] = wanted
        return
    n = om.args.n_layers
    try:
        with progress(notices, "trace", "Tracing…") as step:
            on_block = lambda i: step(i / n, f"Tracing block {i} ({i + 1} of {n})…")  # noqa: E731
            entry = trace_prompt(om, prompt, on_block, generation=generation, chat=chat)
    except BAD_INPUT as exc:
        notices.error(f"**Not traced.** {escape_md(str(exc))}", icon=":material/error:")
        return
    st.session_state["trace_key"] = entry.key


def _ensure_current(om: AppModel | None, notices) -> None:
    """The store may have dropped this session's trace (other sessions filled it): make it again."""
    key = st.session_state.get("trace_key")
    if key is None or store().get(key) is not None:
        return
    if key.traced and key.variant is not None:  # one with patches or interventions is its page's to make:
        key = st.session_state["trace_key"] = key.plain  # show its baseline instead
        if store().get(key) is not None:
            return
    if key.traced:
        try:
            model = om if om is not None and key.on(om) else open_by_key(key.checkpoint, key.dtype)
            trace_prompt(model, key.prompt, generation=key.generation, chat=key.chat)
            return
        except BAD_INPUT as exc:
            notices.error(f"**The trace could not be made again.** {escape_md(str(exc))}", icon=":material/error:")
    upload = st.session_state.get("upload")
    if not key.traced and upload is not None:
        try:
            name_upload(open_upload(upload.getvalue(), upload.name), upload.name)
            return
        except BAD_INPUT:
            pass
    st.session_state["trace_key"] = None


def _nonfinite_notice(notices) -> None:
    """Say where a trace's NaN or infinities begin: the pages still draw it, with gaps and odd colours
    from there on, and the first bad site is where to look for the cause."""
    entry = current_entry()
    if entry is None:
        return
    trace = entry.trace
    bad = entry.memo("nonfinite", lambda: first_nonfinite(trace.tensors, trace.config, trace.n_tokens))
    if bad is None:
        return
    at = "" if bad.position is None else f" at position {bad.position}"
    notices.warning(
        f"**This trace holds non-finite values** (NaN or infinity), first in {code_md(bad.site)}{at}: "
        "the plots from there on show gaps or extreme colours.",
        icon=":material/warning:",
    )


def _block_selector() -> None:
    entry = current_entry()
    st.markdown("#### Block")
    if entry is None:
        st.caption("No trace yet.")
        return
    cfg = entry.trace.config
    if st.session_state.get("block", 0) >= cfg.n_layers:
        st.session_state["block"] = cfg.n_layers - 1
    st.selectbox(
        "Block",
        range(cfg.n_layers),
        key="block",
        format_func=lambda i: f"{i} · {'MoE' if cfg.is_moe(i) else 'dense'}",
        label_visibility="collapsed",
        help="The block the cards and per-block views show",
    )
    trace = entry.trace
    done = "traced" if entry.traced else "read"
    st.caption(f"Showing {trace.n_tokens} tokens from {escape_md(origin(entry))}, {done} in {entry.seconds:.2f} s")
    changed = _changed_since(entry.key) if entry.traced and st.session_state.get("source") != "upload" else []
    if changed:
        st.caption(f":material/edit: Changed since this trace: {', '.join(changed)}. Press **Trace** to see the new one.")


def _changed_since(key: TraceKey) -> list[str]:
    """What the sidebar asks for now that the shown trace does not have: Trace is pressed by hand
    (a trace takes seconds on a real model), so the sidebar says the shown one is out of date."""
    changed = []
    if st.session_state.get("prompt", "") != key.prompt:
        changed.append("the prompt")
    if chat_request() != key.chat:
        changed.append("the chat setting")
    try:
        same = Generation.answers(key.generation, *_generation_settings())
    except InputError:
        same = False
    if not same:
        changed.append("the generation settings")
    return changed
