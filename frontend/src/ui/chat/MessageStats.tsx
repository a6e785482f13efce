import { fmtInt, fmtPct, fmtRate, fmtSeconds } from "../../core/format";
import { turnStats, type Reply } from "./chatState";

export function MessageStats(props: { turn: Reply; testId?: string }) {
  const s = turnStats(props.turn);
  const items: [string, string, string][] = [
    ["TTFT", fmtSeconds(s.ttft), "time to first token"],
    ["speed", s.live && s.tokensPerS !== null ? `${fmtRate(s.tokensPerS)} (live)` : fmtRate(s.tokensPerS),
      s.live ? "tokens per second so far, measured by the browser while the reply streams" : "generated tokens per second of decoding"],
    ["prompt", fmtInt(s.promptTokens), "prompt tokens"],
    ["cached", fmtInt(s.cachedTokens), "prompt tokens served from the prefix cache"],
    ["generated", fmtInt(s.generated), "completion tokens (all choices)"],
    ["finish", s.finish ?? "–", "finish reason"],
  ];
  if (s.preemptions) items.push(["preempted", `×${s.preemptions}`, "times the request was preempted"]);
  if (s.queue !== null) items.push(["queued", fmtSeconds(s.queue), "time waiting before the first step"]);
  if (s.drafted !== null && s.accepted !== null) {
    items.push(["drafted", fmtInt(s.drafted), "speculative decoding: drafted tokens the target model verified"]);
    items.push(["accepted", s.drafted > 0 ? `${fmtInt(s.accepted)} (${fmtPct(s.accepted / s.drafted)})` : fmtInt(s.accepted), "drafted tokens the target model accepted"]);
  }
  return (
    <dl className="stats" data-testid={props.testId ?? "message-stats"} data-live={s.live ? "true" : undefined}>
      {items.map(([k, v, title]) => (
        <div key={k} title={title} data-stat={k}>
          <dt>{k}</dt>
          <dd>{v}</dd>
        </div>
      ))}
    </dl>
  );
}
