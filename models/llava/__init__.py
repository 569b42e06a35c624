"""Real LLaVA data: record files, Hugging Face tokenizers and chat templates, CLIP image
preprocessing, variable images per row, packing, dp balancing, resumable loading."""

from models.llava.images import ImageProcessor as ImageProcessor
from models.llava.loader import Batch as Batch
from models.llava.loader import LlavaData as LlavaData
from models.llava.loader import Loader as Loader
from models.llava.loader import LoaderConfig as LoaderConfig
from models.llava.loader import summary_counts as summary_counts
from models.llava.records import REASONS as REASONS
from models.llava.records import BadSample as BadSample
from models.llava.records import RecordFile as RecordFile
from models.llava.text import TEMPLATES as TEMPLATES
from models.llava.text import HFTokenizer as HFTokenizer
from models.llava.text import render as render

__all__ = [
    "REASONS",
    "TEMPLATES",
    "BadSample",
    "Batch",
    "HFTokenizer",
    "ImageProcessor",
    "LlavaData",
    "Loader",
    "LoaderConfig",
    "RecordFile",
    "render",
    "summary_counts",
]
