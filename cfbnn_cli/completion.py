"""Shell completion for ``cfbnn``: ``eval "$(cfbnn completion bash)"`` (or put that line in ``~/.bashrc``).

Hydra's own ``-sc install=bash`` registers one program name and cannot complete a command of
two words (``cfbnn train regression``). This script completes the command words itself and hands
everything after them to Hydra's completion query of that command (config groups, their
options, keys), as if the command were a program of its own; ``predict`` and ``report`` complete
file names.
"""

from __future__ import annotations

BASH = r"""# cfbnn bash completion: eval "$(cfbnn completion bash)"
_cfbnn_complete()
{
    local cur="${COMP_WORDS[COMP_CWORD]}"
    if (( COMP_CWORD == 1 )); then
        COMPREPLY=($(compgen -W "train vae imagenet-predict predict report completion --help --version" -- "$cur"))
        return
    fi
    local first="${COMP_WORDS[1]}" command skip
    case "$first" in
        train)
            if (( COMP_CWORD == 2 )); then
                COMPREPLY=($(compgen -W "regression" -- "$cur"))
                return
            fi
            command="train regression"; skip=3 ;;
        vae|imagenet-predict)
            command="$first"; skip=2 ;;
        completion)
            COMPREPLY=($(compgen -W "bash" -- "$cur")); return ;;
        predict|report)
            COMPREPLY=($(compgen -f -- "$cur")); return ;;
        *)
            return ;;
    esac
    # the words after the command, as Hydra's query expects them after a program name
    local rest="" i
    for (( i = skip; i < COMP_CWORD; i++ )); do rest="$rest ${COMP_WORDS[i]}"; done
    local line="cfbnn$rest $cur"
    local choices
    choices=$(COMP_LINE="$line" COMP_POINT=${#line} cfbnn $command -sc query=bash 2>/dev/null)
    COMPREPLY=($(compgen -o nospace -W "$choices" -- "$cur"))
}
COMP_WORDBREAKS=${COMP_WORDBREAKS//=}
complete -o nospace -o default -F _cfbnn_complete cfbnn
"""


def script(shell: str) -> str:
    if shell != "bash":
        raise ValueError(f"cfbnn completion: {shell!r} is not supported; `cfbnn completion bash` (zsh: bashcompinit)")
    return BASH
