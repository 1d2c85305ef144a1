"""Real conversation data: LLaVA-format JSON/JSONL records -> the samples ``MultimodalCollator`` batches.

A record::

    {"image": "a.jpg" | ["a.jpg", "b.jpg"], "video": "v.mp4" | [...], "audio": "x.wav" | [...],
     "conversations": [{"from": "human", "value": "<image>\\nWhat is this?"}, {"from": "gpt", "value": "A cat."}, ...]}

Records are read with ``datasets`` (Arrow, memory-mapped: files larger than memory are fine; ``.parquet`` works
too), images with PIL, videos with PyAV (``lightning_mm.data.video``: frames sampled by ``fps`` within
``max_frames``) and audio with soundfile from ``media_root``. Roles ``human``/``user``, ``gpt``/``assistant``
and ``system`` map to the chat roles; the chat template of the processor folder's tokenizer renders the
conversation with the ``<image>``/``<video>``/``<audio>`` markers inline, and every marker becomes one placeholder
token that the collator expands to its encoder's token count.

Labels: only the assistant turns (their content and whatever the template appends to it, e.g. the end-of-turn
token) carry a loss, found by rendering the conversation turn by turn (the template must render a prefix of a
conversation as a prefix of its rendering, which every common template does). ``train_on_prompt=True``
supervises the prompts too. Placeholder, padding and the first token never do.

Truncation to ``max_length`` (counted after placeholder expansion) drops whole trailing turns (a user message and
its answer); a record whose first turn alone is longer is a bad record. An image's tokens are never cut.

Bad records (a missing or unreadable media file, marker counts that differ from the files given, an empty
conversation, an unknown role, a record too long for ``max_length``) raise a ``BadRecordError`` naming the record
index and the file, or with ``on_bad_record="skip"`` are skipped and counted. A file that is not JSON (cut short,
say) raises a ``DataFileError`` naming the file, the record and its line (``lightning_mm.data.records``).

Prompts (``prompts=True``, the data module's predict set): a record's last turn, when it is an assistant's, is
dropped and the rest is rendered with the template's generation prompt, so the model answers it; nothing is
truncated (a prompt longer than ``max_length`` is a bad record).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_mm.data.collator import MultimodalCollator
from lightning_mm.data.media_meta import audio_inputs, audio_length, blank_audio, blank_image, image_inputs, image_size
from lightning_mm.data.metadata import SampleMeta, item_sizes
from lightning_mm.data.processor import MultimodalProcessor
from lightning_mm.data.records import DataFileError, load_records  # noqa: F401  (DataFileError: re-exported)
from lightning_mm.data.resumable import ShardedResumableDataLoader, SkippingDistributedSampler
from lightning_mm.data.video import (SECONDS_PER_GRID_PROCESSORS, VideoOptions, VideoProcessor, load_video_processor,
                                     read_header)
from lightning_mm.loss import IGNORE_INDEX

log = logging.getLogger(__name__)

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
BAD_RECORD_MODES = ("raise", "skip")
MEDIA_KEYS = ("image", "video", "audio")  # record keys of the LLaVA / LLaVA-Video format
KEEP_REASONS = 100  # reasons kept for the first bad records (all are counted)


class BadRecordError(ValueError):
    """A record that cannot become a sample: ``index`` (row of ``data_file``) and ``reason``."""

    def __init__(self, index: int, data_file, reason: str):
        self.index, self.data_file, self.reason = index, data_file, reason
        super().__init__(f"record {index} of {data_file}: {reason}; fix or remove the record, or pass "
                         "on_bad_record='skip' to skip and count bad records")


def modality_kind(encoder) -> str:
    """``"audio"`` for encoders fed log-mel features, ``"video"`` for those fed HF video processors' outputs
    (``video_grid_thw``, ``pixel_values_videos``: a "video" modality through an image tower), else ``"image"``."""
    key = encoder.family.input_key
    return "audio" if key == "input_features" else "video" if key in ("video_grid_thw", "pixel_values_videos") \
        else "image"


def default_record_keys(model) -> dict[str, str]:
    """Encoder name -> record key (``"image"`` / ``"video"`` / ``"audio"``); one encoder per kind, else name
    them."""
    keys = {name: modality_kind(enc) for name, enc in model.encoders.items()}
    for kind in set(keys.values()):
        names = [n for n, k in keys.items() if k == kind]
        if len(names) > 1:
            raise ValueError(f"encoders {names} all take {kind} inputs: say which record key feeds which, e.g. "
                             f"modalities={{{names[0]!r}: 'image', {names[1]!r}: 'image2'}}")
    return keys


# ------------------------------------------------------------------------------------------ the processor folder
def load_processor(path, model, record_keys: dict[str, str] | None = None, video=None) -> MultimodalProcessor:
    """A :class:`MultimodalProcessor` for ``model`` from an HF folder (``save_pretrained`` output).

    The folder holds a tokenizer with a chat template and, per modality, an image processor or a feature
    extractor: in a subfolder named after the encoder (``<path>/vision``, ``<path>/audio``: needed when both an
    image processor and a feature extractor are present, since both are saved as ``preprocessor_config.json``),
    else at the top level, else as the components of the folder's ``AutoProcessor`` when it names a processor
    class (LLaVA, Qwen2-VL, Qwen2-Audio folders). Only the components are used: placeholders are expanded to the
    token counts of this model's encoders, not by the HF processor.

    A video modality takes the folder's video processor (``<path>/<name>/`` or ``<path>/``
    ``video_preprocessor_config.json``; an older Qwen2-VL folder without one: its image processor's config)
    with the sampling options ``video`` (``VideoOptions``: ``{"fps": 2.0, "max_frames": 32, "max_pixels":
    None}``), and adds Qwen2.5-VL's ``second_per_grid_ts`` when the folder's processor class does.
    """
    from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoProcessor, AutoTokenizer, ProcessorMixin

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"processor folder {path} does not exist: save a tokenizer (with a chat template) "
                                "and an image processor / feature extractor into it with save_pretrained")
    record_keys = record_keys or default_record_keys(model)
    try:
        auto = AutoProcessor.from_pretrained(path)
    except ImportError:  # a processor class whose video processor needs torchvision: its parts, loaded one by one
        auto = None
    parts = {}
    if isinstance(auto, ProcessorMixin):
        tokenizer = auto.tokenizer
        parts = {"image": getattr(auto, "image_processor", None), "audio": getattr(auto, "feature_extractor", None)}
    else:
        tokenizer = auto if auto is not None and hasattr(auto, "apply_chat_template") \
            else AutoTokenizer.from_pretrained(path)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer in {path} has no chat template: set tokenizer.chat_template (a Jinja "
                         "template over messages with roles user/assistant/system) and save_pretrained it")
    processors, kwargs = {}, {}
    for name, enc in model.encoders.items():
        kind = modality_kind(enc)
        if kind == "video":
            processors[name] = _video_processor(path, name, auto, video)
            continue
        auto_cls = AutoFeatureExtractor if kind == "audio" else AutoImageProcessor
        if (path / name / "preprocessor_config.json").is_file():
            proc = auto_cls.from_pretrained(path / name)
        elif parts.get(kind) is not None:
            proc = parts[kind]
        elif _top_level_kind(path) == kind:
            proc = auto_cls.from_pretrained(path)
        else:
            what = "a feature extractor" if kind == "audio" else "an image processor"
            raise FileNotFoundError(f"no {what} for modality {name!r} in {path}: save one with save_pretrained into "
                                    f"{path / name} (or into {path} when it is the only one)")
        processors[name] = proc
        if kind == "audio":
            kwargs[name] = {"sampling_rate": proc.sampling_rate}
        elif proc is parts.get("image") and processor_image_kwargs(auto, proc):
            kwargs[name] = processor_image_kwargs(auto, proc)
    markers = {name: f"<{key}>" for name, key in record_keys.items()}
    return MultimodalProcessor(model, tokenizer, processors, markers, kwargs)


def _video_processor(path: Path, name: str, auto, options) -> VideoProcessor:
    """Modality ``name``'s video processor in ``path`` (see ``load_processor``) with the sampling ``options``."""
    folder = path / name if (path / name / "video_preprocessor_config.json").is_file() else path
    hf = getattr(auto, "video_processor", None) if folder == path else None
    if hf is None:
        image_cfg = path / "preprocessor_config.json"
        fallback = json.loads(image_cfg.read_text()) if image_cfg.is_file() else None
        hf = load_video_processor(folder, fallback)
    classes = {type(auto).__name__} if auto is not None else set()
    for file in ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json",
                 "tokenizer_config.json"):
        if (path / file).is_file():
            classes.add(json.loads((path / file).read_text()).get("processor_class"))
    return VideoProcessor(hf, options, seconds_per_grid=bool(classes & set(SECONDS_PER_GRID_PROCESSORS)))


def processor_image_kwargs(processor, image_processor) -> dict:
    """The image arguments a HF processor adds when it calls its image processor (its ``images_kwargs`` and
    kwargs defaults, e.g. InternVL's ``crop_to_patches=True``), less those the image processor already has, so
    the images are processed as the HF processor processes them."""
    defaults = dict(getattr(processor, "images_kwargs", None) or {})
    kwargs_class = getattr(processor, "valid_processor_kwargs", None)
    defaults.update(getattr(kwargs_class, "_defaults", {}).get("images_kwargs", {}))
    missing = object()
    return {k: v for k, v in defaults.items()
            if k != "return_tensors" and getattr(image_processor, k, missing) != v}


def _top_level_kind(path: Path) -> str | None:
    cfg = path / "preprocessor_config.json"
    if not cfg.is_file():
        return None
    d = json.loads(cfg.read_text())
    if "feature_extractor_type" in d and "image_processor_type" not in d:
        return "audio"
    return "image"


# ------------------------------------------------------------------------------------------ records
def _as_list(value) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _load_image(file: Path):
    from PIL import Image

    with Image.open(file) as img:
        return img.convert("RGB")


def _load_audio(file: Path, sampling_rate: int):
    import soundfile

    wave, rate = soundfile.read(str(file), dtype="float32", always_2d=True)
    wave = wave.mean(axis=1)
    if rate != sampling_rate:
        try:
            from scipy.signal import resample_poly

            g = np.gcd(int(rate), int(sampling_rate))
            wave = resample_poly(wave, sampling_rate // g, rate // g).astype(np.float32)
        except ImportError:  # linear interpolation without scipy
            t = np.arange(int(len(wave) * sampling_rate / rate)) * (rate / sampling_rate)
            wave = np.interp(t, np.arange(len(wave)), wave).astype(np.float32)
    return wave


class ConversationDataset(Dataset):
    """Records of ``data_path`` as unexpanded samples (``input_ids`` with one placeholder per item, ``labels``,
    and per modality its encoder inputs) for ``processor.model``.

    ``scan=True`` checks every record's structure and media files up front (on_bad_record="raise": the first bad
    record raises before training; "skip": bad records leave the index). A record found bad only while loading
    (an unreadable file, too long) raises, or in skip mode is replaced by the next good record so batches keep
    their size. ``num_bad_records`` counts skipped records; ``bad_records`` keeps (index, reason) of the first ones.
    ``sample_metadata(i)`` gives sample i's token counts from the record and the media headers alone (what the
    balanced batch sampler and ``lightning-mm plan --data-stats`` read), cached per record. ``prompts=True``: each
    sample is the record's prompt for generation (its last assistant turn dropped, the generation prompt added).
    """

    def __init__(self, data_path, processor: MultimodalProcessor, media_root=None, max_length: int | None = None,
                 train_on_prompt: bool = False, on_bad_record: str = "raise", system_prompt: str | None = None,
                 record_keys: dict[str, str] | None = None, scan: bool = True, cache_dir=None, records=None,
                 prompts: bool = False):
        if on_bad_record not in BAD_RECORD_MODES:
            raise ValueError(f"on_bad_record must be one of {BAD_RECORD_MODES}, got {on_bad_record!r}")
        self.data_path = Path(data_path)
        self.records = records if records is not None else load_records(data_path, cache_dir)
        self.processor, self.model = processor, processor.model
        self.media_root = Path(media_root) if media_root is not None else self.data_path.parent
        self.max_length, self.train_on_prompt, self.on_bad_record = max_length, train_on_prompt, on_bad_record
        self.system_prompt, self.prompts = system_prompt, prompts
        self.record_keys = record_keys or {name: m.strip("<>") for name, m in processor.markers.items()}
        self.num_bad_records, self.bad_records = 0, []
        self._metadata: dict[int, SampleMeta] = {}  # record index -> its metadata, read on first use
        self.indices = np.array(self.scan() if scan else range(len(self.records)), dtype=np.int64)

    def __len__(self) -> int:
        return len(self.indices)

    # ---------------------------------------------------------------- checks
    def _bad(self, index: int, reason: str) -> BadRecordError:
        return BadRecordError(index, self.data_path, reason)

    def _count(self, err: BadRecordError) -> None:
        self.num_bad_records += 1
        if len(self.bad_records) < KEEP_REASONS:
            self.bad_records.append((err.index, err.reason))

    def parse(self, index: int, record: dict) -> tuple[list[dict], dict[str, list[Path]]]:
        """Chat messages (markers inline, ``<image>`` prepended when the record has images but no marker) and
        each modality's media files; raises BadRecordError on a malformed record."""
        turns = record.get("conversations")
        if isinstance(turns, str):
            turns = json.loads(turns)
        if not turns:
            raise self._bad(index, "empty conversation (no 'conversations' turns)")
        messages = []
        for t, turn in enumerate(turns):
            role = ROLES.get(str(turn.get("from", turn.get("role", ""))).lower())
            if role is None:
                raise self._bad(index, f"turn {t} has role {turn.get('from', turn.get('role'))!r}; expected one of "
                                       f"{sorted(ROLES)}")
            value = turn.get("value", turn.get("content"))
            if not isinstance(value, str):
                raise self._bad(index, f"turn {t} has no text value")
            messages.append({"role": role, "content": value})
        if self.prompts:  # the question(s) only: the answer to generate is dropped
            if messages[-1]["role"] == "assistant":
                messages.pop()
            if not any(m["role"] == "user" for m in messages):
                raise self._bad(index, "no user turn to answer (a prompt needs one before its last assistant turn)")
        elif not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
            raise self._bad(index, "empty conversation (no assistant turn with text)")
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        for key in MEDIA_KEYS:
            if key not in self.record_keys.values() and _as_list(record.get(key)):
                raise self._bad(index, f"it has {key} files but the model has no encoder reading {key!r} records "
                                       f"(encoders: {self.record_keys})")
        media = {}
        for name, key in self.record_keys.items():
            files = _as_list(record.get(key))
            marker = self.processor.markers[name]
            found = sum(m["content"].count(marker) for m in messages)
            if files and not found:  # LLaVA convention: the images come first in the first user turn
                first = next((m for m in messages if m["role"] == "user"), None)
                if first is None:
                    raise self._bad(index, f"{len(files)} {key} file(s) but no user turn to put {marker} into")
                first["content"] = (marker + "\n") * len(files) + first["content"]
            elif found != len(files):
                raise self._bad(index, f"{found} {marker} marker(s) in the conversation but {len(files)} {key} "
                                       f"file(s) {files}; give one file per marker")
            media[name] = [self.media_root / f for f in files]
        return messages, media

    def check_files(self, index: int, media: dict[str, list[Path]]) -> None:
        for files in media.values():
            for file in files:
                if not file.is_file():
                    raise self._bad(index, f"media file {file} not found (media_root={self.media_root})")

    def scan(self) -> list[int]:
        """Indices of the records whose structure and files are good (raises on the first bad one in raise mode)."""
        wanted = ("conversations", *self.record_keys.values(), *MEDIA_KEYS)
        cols = [c for c in dict.fromkeys(wanted) if c in self.records.column_names]
        good = []
        at = 0
        for rows in self.records.select_columns(cols).iter(batch_size=1024):
            n = len(rows[cols[0]]) if cols else 0
            for j in range(n):
                index = at + j
                try:
                    _, media = self.parse(index, {c: rows[c][j] for c in cols})
                    self.check_files(index, media)
                    good.append(index)
                except BadRecordError as err:
                    if self.on_bad_record == "raise":
                        raise
                    self._count(err)
            at += n
        if self.num_bad_records:
            index, reason = self.bad_records[0]
            rank_zero_warn(f"{self.data_path}: skipped {self.num_bad_records} bad record(s) of {len(self.records)} "
                           f"(on_bad_record='skip'); the first: record {index}: {reason}")
        return good

    # ---------------------------------------------------------------- one record -> one sample
    def render(self, index: int, messages: list[dict]) -> tuple[list[tuple[str, bool]], list[int]]:
        """The rendered conversation as (text, supervised) pieces, and the piece count after each assistant turn.

        Trailing messages after the last assistant turn are dropped (nothing to learn from them); for prompts
        they are the last piece, rendered with the generation prompt."""
        tok = self.processor.tokenizer

        def render(msgs, gen):
            try:
                return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            except Exception as err:  # noqa: BLE001  (the template's own error on this record)
                raise self._bad(index, f"the chat template failed on it ({type(err).__name__}: {err})") from err

        pieces, ends, done = [], [], ""
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt, full = render(messages[:i], True), render(messages[: i + 1], False)
            if not prompt.startswith(done) or not full.startswith(prompt):
                raise ValueError(
                    f"record {index} of {self.data_path}: the chat template does not render a conversation's prefix "
                    f"as a prefix of its rendering (turn {i}), so assistant turns cannot be located; use a template "
                    "whose earlier turns do not change when a turn is added")
            pieces += [(prompt[len(done):], self.train_on_prompt), (full[len(prompt):], True)]
            ends.append(len(pieces))
            done = full
        if self.prompts:
            prompt = render(messages, True)
            if not prompt.startswith(done):
                raise ValueError(f"record {index} of {self.data_path}: the chat template does not render a "
                                 "conversation's prefix as a prefix of its rendering (the generation prompt)")
            pieces.append((prompt[len(done):], False))
        return pieces, ends

    def _kept(self, index: int, n_ids: int, counts: dict, bounds: list, tokens: dict) -> tuple[int, dict]:
        """Where ``max_length`` cuts a sample: ``(ids kept, items kept per modality)``, at the last turn boundary
        (``bounds``) whose expanded length fits; raises when even the first turn does not."""
        def expanded(ids, items):
            return ids + sum(sum(tokens[m][:k]) - k for m, k in items.items() if k)

        if self.max_length is None or expanded(n_ids, counts) <= self.max_length:
            return n_ids, counts
        if self.prompts:  # cutting turns would cut the question
            raise self._bad(index, f"the prompt is {expanded(n_ids, counts)} tokens after placeholder expansion, "
                                   f"more than max_length={self.max_length}")
        fits = [(n, c) for n, c in bounds if expanded(n, c) <= self.max_length]
        if not fits:
            raise self._bad(index, f"its first turn alone is {expanded(*bounds[0])} tokens after placeholder "
                                   f"expansion, more than max_length={self.max_length}")
        return fits[-1]

    def _load_media(self, index: int, name: str, files: list[Path]) -> tuple[dict, list | None]:
        """The encoder inputs of ``files`` and each item's expansion (``MultimodalProcessor.item_ids``)."""
        kind = modality_kind(self.model.encoders[name])
        items = []
        for file in files:
            try:
                if kind == "audio":
                    items.append(_load_audio(file, self.processor.processors[name].sampling_rate))
                elif kind == "video":
                    items.append(self.processor.processors[name].read(file))
                else:
                    items.append(_load_image(file))
            except Exception as err:  # noqa: BLE001  (any decoder error is this record's problem)
                raise self._bad(index, f"cannot read {kind} file {file} ({type(err).__name__}: {err})") from err
        inputs = self.processor.encode_items(name, items)
        return inputs, self.processor.item_ids(name, inputs, self.processor.video_metadata(items)
                                               if kind == "video" else None)

    def encode(self, index: int) -> dict:
        """The sample of record ``index`` (raises BadRecordError)."""
        messages, media = self.parse(index, self.records[int(index)])
        self.check_files(index, media)
        pieces, ends = self.render(index, messages)
        ids, labels, bounds = [], [], []
        counts = {name: 0 for name in media}
        placeholders = set(self.model.placeholder_ids.values())
        e = 0
        for p, (text, supervised) in enumerate(pieces):
            t_ids, t_counts = self.processor.tokenize(text)
            ids += t_ids
            labels += [t if supervised and t not in placeholders else IGNORE_INDEX for t in t_ids]
            for name, c in t_counts.items():
                counts[name] = counts.get(name, 0) + c
            if e < len(ends) and p + 1 == ends[e]:
                bounds.append((len(ids), dict(counts)))
                e += 1
        for name, files in media.items():  # markers the template rendered vs files given
            if counts.get(name, 0) > len(files):
                raise self._bad(index, f"the rendered conversation holds {counts[name]} "
                                       f"{self.processor.markers[name]} markers but {len(files)} files were given")
        inputs, tokens, framed = {}, {}, {}
        for name, files in media.items():
            used = counts.get(name, 0)
            if used:
                inputs[name], framed[name] = self._load_media(index, name, files[:used])
                tokens[name] = self.model.encoders[name].num_tokens(inputs[name]) if framed[name] is None \
                    else [len(f) for f in framed[name]]

        end, kept = self._kept(index, len(ids), counts, bounds, tokens)
        sample = {"input_ids": torch.tensor(ids[:end], dtype=torch.long),
                  "labels": torch.tensor(labels[:end], dtype=torch.long)}
        for name, k in kept.items():
            if k:
                enc = self.model.encoders[name]
                sample[name] = (inputs[name] if k == len(tokens[name])
                                else enc.family.select_items(inputs[name], torch.arange(k)))
                if framed[name] is not None:
                    sample.setdefault("item_ids", {})[name] = framed[name][:k]
        return sample

    def __getitem__(self, i: int) -> dict:
        for attempt in range(len(self.indices)):
            index = int(self.indices[(i + attempt) % len(self.indices)])
            try:
                return self.encode(index)
            except BadRecordError as err:
                if self.on_bad_record == "raise":
                    raise
                self._count(err)
                log.warning("skipping record %s of %s: %s (on_bad_record='skip')", err.index, err.data_file,
                            err.reason)
        raise RuntimeError(f"no record of {self.data_path} could be loaded ({self.num_bad_records} bad records)")

    # ---------------------------------------------------------------- metadata (no media decoded, no tensors)
    def sample_metadata(self, i: int) -> SampleMeta:
        """The token counts of ``self[i]`` (``SampleMeta``) from the record, the chat template, the tokenizer and
        the media headers: image sizes (PIL reads the header only) and clip lengths (``soundfile.info``) become
        the processor's output shapes (``media_meta``), and the encoder's ``num_tokens`` counts on those, so the
        counts, truncation to ``max_length`` included, are those of the encoded sample. Cached per record.

        A record whose metadata cannot be read raises BadRecordError naming it and the file; with
        on_bad_record="skip" the next good record stands in, as ``self[i]`` does (counted when it is loaded)."""
        for attempt in range(len(self.indices)):
            index = int(self.indices[(i + attempt) % len(self.indices)])
            try:
                return self.record_metadata(index)
            except BadRecordError as err:
                if self.on_bad_record == "raise":
                    raise
                log.warning("metadata: skipping record %s of %s: %s (on_bad_record='skip')", err.index,
                            err.data_file, err.reason)
        raise RuntimeError(f"no record of {self.data_path} has readable metadata")

    def record_metadata(self, index: int) -> SampleMeta:
        """``sample_metadata`` of record ``index`` (a row of the data file); raises BadRecordError."""
        if index not in self._metadata:
            self._metadata[index] = self._read_metadata(index)
        return self._metadata[index]

    def _read_metadata(self, index: int) -> SampleMeta:
        messages, media = self.parse(index, self.records[int(index)])
        self.check_files(index, media)
        pieces, ends = self.render(index, messages)
        ids, bounds = [], []  # as encode tokenizes: the piece boundaries after each assistant turn
        counts = {name: 0 for name in media}
        e = 0
        for p, (text, _) in enumerate(pieces):
            t_ids, t_counts = self.processor.tokenize(text)
            ids += t_ids
            for name, c in t_counts.items():
                counts[name] = counts.get(name, 0) + c
            if e < len(ends) and p + 1 == ends[e]:
                bounds.append((len(ids), dict(counts)))
                e += 1
        for name, files in media.items():
            if counts.get(name, 0) > len(files):
                raise self._bad(index, f"the rendered conversation holds {counts[name]} "
                                       f"{self.processor.markers[name]} markers but {len(files)} files were given")
        sizes, tokens = {}, {}  # tokens: each item's whole expansion (its family's text around it included)
        for name, files in media.items():
            if counts.get(name, 0):
                sizes[name], tokens[name] = self._item_sizes(index, name, files[: counts[name]])

        end, kept = self._kept(index, len(ids), counts, bounds, tokens)
        placeholders = set(self.model.placeholder_ids.values())
        items = {name: sizes[name][:k] for name, k in kept.items() if k}
        framing = sum(sum(tokens[name][:k]) - sum(n for _, n in items[name]) for name, k in kept.items() if k)
        return SampleMeta(sum(1 for t in ids[:end] if t not in placeholders) + framing, items)

    def _item_sizes(self, index: int, name: str, files: list[Path]) -> tuple[tuple[tuple[int, int], ...], list[int]]:
        """(positions through the encoder's layers, LLM tokens) of each of ``files`` (modality ``name``) from their
        headers (``metadata.item_sizes``), and the length of each one's expansion (``MultimodalProcessor.item_ids``:
        its tokens and the text its family writes around them)."""
        enc, proc = self.model.encoders[name], self.processor.processors[name]
        kind, kwargs = modality_kind(enc), self.processor.call_kwargs(name)
        plain = enc.preprocess is None and enc._num_tokens is None
        sizes = []
        for file in files:
            try:
                sizes.append(audio_length(file, proc.sampling_rate) if kind == "audio" else
                             read_header(file) if kind == "video" else image_size(file))
            except Exception as err:  # noqa: BLE001  (any header error is this record's problem)
                raise self._bad(index, f"cannot read the {kind} header of {file} ({type(err).__name__}: {err})") \
                    from err
        metadatas = None
        if kind == "video":  # frames sampled and sized by the rules decoding applies (VideoProcessor)
            inputs, metadatas = proc.header_inputs(sizes, blank=not plain), [proc.sampled(m) for m in sizes]
        else:
            # Shapes on the meta device where the processor's rules are known and the encoder counts by shape
            # alone; otherwise the processor runs on blank media of the same sizes (the real files' shapes).
            inputs = (audio_inputs(proc, sizes, kwargs) if kind == "audio" else image_inputs(proc, sizes, kwargs)) \
                if plain else None
            if inputs is None:
                blanks = [blank_audio(s) if kind == "audio" else blank_image(s) for s in sizes]
                inputs = self.processor.encode_items(name, blanks)
        out = item_sizes(enc, inputs)
        framed = self.processor.item_ids(name, inputs, metadatas)
        return out, [n for _, n in out] if framed is None else [len(f) for f in framed]


# ------------------------------------------------------------------------------------------ the data module
class ConversationDataModule(pl.LightningDataModule):
    """LLaVA-format conversations for the model of the running ``MultimodalLightningModule`` (or ``model=``).

    ``processor``: an HF folder (see :func:`load_processor`) or a ready :class:`MultimodalProcessor`.
    ``max_length``: longest sample after placeholder expansion (trailing turns dropped to fit); with
    ``pack=True`` samples are packed into rows of ``max_length`` tokens with ``segment_ids``.
    ``on_bad_record``: "raise" or "skip" (counted in ``num_bad_records``). ``modalities`` maps encoder names
    to record keys (default: the image encoder reads ``"image"``, a video encoder ``"video"``, the audio encoder
    ``"audio"``; markers are ``<key>``). ``causal_modalities``: the collator's attention pattern for modality tokens
    (None: the model's, HF's plain causal one for a composite checkpoint). ``video``: how videos are sampled,
    ``{"fps": 2.0, "max_frames": 32, "max_pixels": None}`` (``VideoOptions``; ``max_pixels`` narrows the video
    processor's own pixel budget; a ready ``MultimodalProcessor`` brings its own). Each data-parallel replica reads
    its own shard (``trainer.distributed_sampler_kwargs``: every rank of a replica sees the same batches; the tail
    that does not divide evenly is dropped), reshuffled per epoch with ``seed``; the train loader resumes mid-epoch
    from a checkpoint.

    ``predict_data_path`` (default: ``val_data_path``) serves ``trainer.predict`` prompts: each record up to its
    last assistant turn, rendered with the chat template's generation prompt, no answer tokens (``prompts=True``
    of :class:`ConversationDataset`), in file order, each sample once over the replicas (Lightning's
    ``UnrepeatedDistributedSampler``), never packed. With ``MultimodalLightningModule(generation=...)`` and
    ``lightning_mm.callbacks.GenerationWriter`` the answers are written as text.
    """

    def __init__(self, data_path: str, media_root: str | None = None,
                 processor: str | MultimodalProcessor | None = None, batch_size: int = 8,
                 max_length: int | None = None, train_on_prompt: bool = False,
                 pack: bool = False, pad_to_multiple_of: int = 1, on_bad_record: str = "raise",
                 val_data_path: str | None = None, shuffle: bool = True, seed: int = 0, num_workers: int = 0,
                 system_prompt: str | None = None, modalities: dict[str, str] | None = None,
                 causal_modalities: bool | None = None, scan: bool = True, cache_dir: str | None = None,
                 video: dict | None = None, predict_data_path: str | None = None, model=None):
        super().__init__()
        if processor is None:
            raise ValueError("ConversationDataModule needs processor=: an HF folder with a tokenizer (chat template) "
                             "and image processor / feature extractor, or a MultimodalProcessor")
        if pack and not max_length:
            raise ValueError("pack=True packs samples into rows of max_length tokens: set max_length")
        if on_bad_record not in BAD_RECORD_MODES:
            raise ValueError(f"on_bad_record must be one of {BAD_RECORD_MODES}, got {on_bad_record!r}")
        VideoOptions.of(video)  # a bad option fails here, before the model exists
        is_path = isinstance(processor, (str, os.PathLike))
        self.save_hyperparameters(ignore=["model"] + ([] if is_path else ["processor"]))
        self._model, self._processor = model, None if is_path else processor
        self.train_dataset = self.val_dataset = self.predict_dataset = None

    @property
    def model(self):
        if self._model is not None:
            return self._model
        if self.trainer is None or self.trainer.lightning_module is None:
            raise RuntimeError("ConversationDataModule needs the model: pass model=... or use it with a Trainer and "
                               "a MultimodalLightningModule")
        return self.trainer.lightning_module.model

    @property
    def processor(self) -> MultimodalProcessor:
        if self._processor is None:
            self._processor = load_processor(self.hparams.processor, self.model, self.hparams.modalities,
                                             self.hparams.video)
        return self._processor

    @property
    def num_bad_records(self) -> int:
        """Records skipped so far (on_bad_record='skip'), train, validation and predict."""
        return sum(d.num_bad_records for d in (self.train_dataset, self.val_dataset, self.predict_dataset)
                   if d is not None)

    @property
    def predict_path(self) -> str | None:
        """The file of the predict prompts: ``predict_data_path``, else ``val_data_path``."""
        return self.hparams.predict_data_path or self.hparams.val_data_path

    def prepare_data(self) -> None:  # fills the datasets cache once per node
        for path in (self.hparams.data_path, self.hparams.val_data_path, self.hparams.predict_data_path):
            if path:
                load_records(path, self.hparams.cache_dir)

    def _dataset(self, path, prompts: bool = False) -> ConversationDataset:
        h = self.hparams
        return ConversationDataset(path, self.processor, h.media_root, h.max_length, h.train_on_prompt,
                                   h.on_bad_record, h.system_prompt, h.modalities, h.scan, h.cache_dir,
                                   prompts=prompts)

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is None and stage in (None, "fit"):
            self.train_dataset = self._dataset(self.hparams.data_path)
        if self.val_dataset is None and self.hparams.val_data_path and stage in (None, "fit", "validate"):
            self.val_dataset = self._dataset(self.hparams.val_data_path)
        if self.predict_dataset is None and self.predict_path and stage in (None, "predict"):
            self.predict_dataset = self._dataset(self.predict_path, prompts=True)

    def collator(self, prompts: bool = False) -> MultimodalCollator:
        """The batches' collator; for prompts, rows padded to the longest prompt (generation takes no packed
        rows, and ``max_length`` already bounds each prompt)."""
        h = self.hparams
        pad = getattr(self.processor.tokenizer, "pad_token_id", None)
        return MultimodalCollator(self.model, seq_len=None if prompts else h.max_length, pack=h.pack and not prompts,
                                  pad_to_multiple_of=h.pad_to_multiple_of, pad_token_id=pad if pad is not None else 0,
                                  causal_modalities=h.causal_modalities)

    def replica(self) -> dict:
        """``{"num_replicas": dp, "rank": dp_rank}`` of this process (1 and 0 without a distributed trainer)."""
        kw = getattr(self.trainer, "distributed_sampler_kwargs", None) if self.trainer is not None else None
        return {"num_replicas": kw["num_replicas"], "rank": kw["rank"]} if kw else {"num_replicas": 1, "rank": 0}

    def train_dataloader(self) -> ShardedResumableDataLoader:
        if self.train_dataset is None:
            self.setup("fit")
        h = self.hparams
        sampler = SkippingDistributedSampler(self.train_dataset, shuffle=h.shuffle, seed=h.seed, drop_last=True,
                                             **self.replica())
        return ShardedResumableDataLoader(self.train_dataset, sampler=sampler, batch_size=h.batch_size,
                                          drop_last=True, collate_fn=self.collator(), num_workers=h.num_workers)

    @property
    def val_dataloader(self):
        """The validation loader's hook, or, without ``val_data_path``, LightningDataModule's own (not overridden),
        so Lightning runs no validation loop instead of one over an empty list."""
        return self._val_dataloader if self.hparams.val_data_path else super().val_dataloader

    def _val_dataloader(self):
        if self.val_dataset is None:
            self.setup("validate")
        sampler = DistributedSampler(self.val_dataset, shuffle=False, drop_last=False, **self.replica())
        return DataLoader(self.val_dataset, sampler=sampler, batch_size=self.hparams.batch_size,
                          collate_fn=self.collator(), num_workers=self.hparams.num_workers)

    def predict_dataloader(self) -> DataLoader:
        """The prompts of ``predict_data_path`` (else ``val_data_path``), this replica's share, in file order."""
        if not self.predict_path:
            raise ValueError("ConversationDataModule has no predict data: set predict_data_path (or val_data_path), "
                             "e.g. --data.init_args.predict_data_path=prompts.json")
        if self.predict_dataset is None:
            self.setup("predict")
        sampler = UnrepeatedDistributedSampler(self.predict_dataset, shuffle=False, **self.replica())
        return DataLoader(self.predict_dataset, sampler=sampler, batch_size=self.hparams.batch_size,
                          collate_fn=self.collator(prompts=True), num_workers=self.hparams.num_workers)
