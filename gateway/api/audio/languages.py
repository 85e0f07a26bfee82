"""Spoken languages by ISO-639-1 code (Whisper's list, which OpenAI's verbose_json names
them from): a transcript says the language heard by its lowercase English name."""

from __future__ import annotations

_NAMES = (
    "en english|zh chinese|de german|es spanish|ru russian|ko korean|fr french|ja japanese|"
    "pt portuguese|tr turkish|pl polish|ca catalan|nl dutch|ar arabic|sv swedish|it italian|"
    "id indonesian|hi hindi|fi finnish|vi vietnamese|he hebrew|uk ukrainian|el greek|"
    "ms malay|cs czech|ro romanian|da danish|hu hungarian|ta tamil|no norwegian|th thai|"
    "ur urdu|hr croatian|bg bulgarian|lt lithuanian|la latin|mi maori|ml malayalam|cy welsh|"
    "sk slovak|te telugu|fa persian|lv latvian|bn bengali|sr serbian|az azerbaijani|"
    "sl slovenian|kn kannada|et estonian|mk macedonian|br breton|eu basque|is icelandic|"
    "hy armenian|ne nepali|mn mongolian|bs bosnian|kk kazakh|sq albanian|sw swahili|"
    "gl galician|mr marathi|pa punjabi|si sinhala|km khmer|sn shona|yo yoruba|so somali|"
    "af afrikaans|oc occitan|ka georgian|be belarusian|tg tajik|sd sindhi|gu gujarati|"
    "am amharic|yi yiddish|lo lao|uz uzbek|fo faroese|ht haitian creole|ps pashto|"
    "tk turkmen|nn nynorsk|mt maltese|sa sanskrit|lb luxembourgish|my myanmar|bo tibetan|"
    "tl tagalog|mg malagasy|as assamese|tt tatar|haw hawaiian|ln lingala|ha hausa|"
    "ba bashkir|jw javanese|su sundanese|yue cantonese"
)
LANGUAGES = {code: name for code, _, name in (pair.partition(" ") for pair in _NAMES.split("|"))}
CODES = {name: code for code, name in LANGUAGES.items()}


def language_name(language: str | None) -> str:
    """The English name of a language given by code ("en") or name ("English"); an unknown
    one as given, lowercased; none: ""."""
    if not language:
        return ""
    key = language.strip().lower()
    return LANGUAGES.get(key, key)


def language_code(language: str) -> str | None:
    """The code of a language given by code or English name; None for an unknown one."""
    key = language.strip().lower()
    if key in LANGUAGES:
        return key
    return CODES.get(key)
