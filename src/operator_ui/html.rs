//! The operator page's HTML: server-rendered, no script, one inline style
//! sheet, every value escaped. Charts are inline SVG.

use std::fmt::Write as _;

use crate::clock::rfc3339;
use crate::store::{Activity, DeliveryRecord, InboxEntry, Operation, PusharyCall, Transition};

pub use crate::html::esc;

/// Percent-encodes a value for a query string or path segment.
pub fn enc(text: &str) -> String {
    url::form_urlencoded::byte_serialize(text.as_bytes()).collect()
}

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d232a;background:#f6f7f9}\
header{background:#1d232a;color:#fff;padding:10px 20px;display:flex;gap:20px;align-items:center}\
header a{color:#cfe3ff;text-decoration:none}header b{margin-right:20px}main{padding:16px 20px}\
table{border-collapse:collapse;width:100%;background:#fff;margin:8px 0 20px}\
th,td{text-align:left;padding:5px 8px;border-bottom:1px solid #e3e6ea;vertical-align:top}\
th{background:#eef1f4;font-weight:600}.s{display:inline-block;padding:1px 7px;border-radius:9px;background:#e3e6ea}\
.uncertain,.orphaned,.failed,.unreachable,.invalid{background:#ffd9d6}.succeeded,.processed{background:#d6f5dd}\
.pending,.new{background:#fff3c4}.cards{display:flex;gap:12px;flex-wrap:wrap}\
.card{background:#fff;padding:8px 14px;border-radius:6px;border:1px solid #e3e6ea}\
.card{color:inherit;text-decoration:none}.card b{font-size:20px;display:block}form.inline{display:flex;gap:6px;flex-wrap:wrap;align-items:center}\
input,select,button{font:inherit;padding:3px 6px}button{cursor:pointer}.err{color:#a40e0e;font-weight:600}\
.ok{color:#0b6b26;font-weight:600}code{font-size:12px}.muted{color:#68717a}";

pub fn page(title: &str, body: &str) -> String {
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{t} · approvald</title>\
         <meta name=\"viewport\" content=\"width=device-width\"><style>{STYLE}</style></head><body>\
         <header><b>approvald operator</b><a href=\"/operator\">Overview</a>\
         <a href=\"/operator/operations\">Operations</a><a href=\"/operator/inbox\">Inbox</a>\
         <a href=\"/operator/operations?state=uncertain\">Uncertain</a>\
         <form method=\"post\" action=\"/operator/logout\" style=\"margin-left:auto\"><button>Sign out</button></form>\
         </header><main><h1>{t}</h1>{body}</main></body></html>",
        t = esc(title)
    )
}

pub fn login(message: Option<&str>) -> String {
    let msg = message.map(|m| format!("<p class=\"err\">{}</p>", esc(m))).unwrap_or_default();
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>Sign in · approvald</title>\
         <style>{STYLE}</style></head><body><main><h1>approvald operator</h1>{msg}\
         <form method=\"post\" action=\"/operator/login\" class=\"inline\">\
         <label>Operator token <input type=\"password\" name=\"token\" autocomplete=\"current-password\" required></label>\
         <button>Sign in</button></form></main></body></html>"
    )
}

pub fn state_badge(state: &str) -> String {
    format!("<span class=\"s {0}\">{0}</span>", esc(state))
}

pub fn age(now: i64, then: i64) -> String {
    let s = (now - then).max(0) / 1000;
    match s {
        0..=59 => format!("{s}s"),
        60..=3599 => format!("{}m", s / 60),
        3600..=86_399 => format!("{}h {}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d {}h", s / 86_400, (s % 86_400) / 3600),
    }
}

pub fn operations_table(ops: &[Operation], now: i64) -> String {
    if ops.is_empty() {
        return "<p class=\"muted\">No operations match.</p>".into();
    }
    let mut out = String::from(
        "<table id=\"operations\"><tr><th>Operation</th><th>State</th><th>Tenant</th><th>Thread</th>\
         <th>Recipient</th><th>Effect</th><th>Created</th><th>Age</th><th>Last error</th></tr>",
    );
    for op in ops {
        let _ = write!(
            out,
            "<tr><td><a href=\"/operator/operations/{id_enc}\"><code>{id}</code></a></td><td>{state}</td>\
             <td>{tenant}</td><td><a href=\"/operator/operations?thread={thread_enc}\">{thread}</a></td>\
             <td>{recipient}</td><td>{effect}</td><td>{created}</td><td>{age}</td><td>{error}</td></tr>",
            id_enc = enc(&op.id),
            id = esc(&op.id),
            state = state_badge(op.state.as_str()),
            tenant = esc(&op.tenant),
            thread_enc = enc(&op.thread_id),
            thread = esc(&op.thread_id),
            recipient = esc(&op.spec.external_id),
            effect = esc(&op.effect),
            created = rfc3339(op.created_at),
            age = age(now, op.created_at),
            error = esc(op.last_error.as_deref().unwrap_or("")),
        );
    }
    out.push_str("</table>");
    out
}

pub fn resolve_form(op: &Operation) -> String {
    format!(
        "<form method=\"post\" action=\"/operator/operations/{}/resolve\" class=\"inline resolve\">\
         <select name=\"outcome\" aria-label=\"outcome\"><option value=\"succeeded\">it ran: succeeded</option>\
         <option value=\"failed\">it did not run: failed</option></select>\
         <input name=\"note\" placeholder=\"why (required)\" required maxlength=\"2000\" aria-label=\"note\">\
         <input name=\"by\" placeholder=\"your name\" required maxlength=\"128\" aria-label=\"by\">\
         <button>Resolve</button></form>",
        enc(&op.id)
    )
}

pub fn inbox_table(entries: &[InboxEntry], now: i64) -> String {
    if entries.is_empty() {
        return "<p class=\"muted\">No inbox entries match.</p>".into();
    }
    let mut out = String::from(
        "<table id=\"inbox\"><tr><th>#</th><th>State</th><th>Tenant</th><th>Decision</th><th>Answer</th>\
         <th>Source</th><th>Received</th><th>Age</th><th>Duplicates</th><th>Operation</th><th>Note</th></tr>",
    );
    for e in entries {
        let op = e
            .operation_id
            .as_deref()
            .map(|id| format!("<a href=\"/operator/operations/{}\"><code>{}</code></a>", enc(id), esc(id)))
            .unwrap_or_default();
        let _ = write!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td><code>{}</code></td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{op}</td><td>{}</td></tr>",
            e.id,
            state_badge(&e.state),
            esc(&e.tenant),
            esc(&e.correlation_id),
            esc(&e.answer),
            esc(&e.source),
            rfc3339(e.received_at),
            age(now, e.received_at),
            e.duplicates,
            esc(e.note.as_deref().unwrap_or("")),
        );
    }
    out.push_str("</table>");
    out
}

/// One operation's history: transitions, inbox entries, Pushary calls and
/// delivery attempts, merged by time.
pub fn timeline(
    transitions: &[Transition],
    inbox: &[InboxEntry],
    calls: &[PusharyCall],
    deliveries: &[DeliveryRecord],
) -> String {
    let mut rows: Vec<(i64, u8, String)> = Vec::new();
    for t in transitions {
        let from = t.from.as_deref().map(state_badge).unwrap_or_else(|| "—".into());
        rows.push((
            t.at,
            2,
            format!(
                "<td>transition</td><td>{from} → {}</td><td>{} <span class=\"muted\">({})</span></td>",
                state_badge(&t.to),
                esc(&t.cause),
                esc(&t.actor)
            ),
        ));
    }
    for e in inbox {
        rows.push((
            e.received_at,
            1,
            format!(
                "<td>inbox entry #{}</td><td>{}</td><td>answer <b>{}</b> via {}; {} duplicate(s){}</td>",
                e.id,
                state_badge(&e.state),
                esc(&e.answer),
                esc(&e.source),
                e.duplicates,
                e.note.as_deref().map(|n| format!("; {}", esc(n))).unwrap_or_default()
            ),
        ));
    }
    for c in calls {
        let result = match (&c.error, c.status_code) {
            (None, _) => "ok".to_string(),
            (Some(e), _) => format!("<span class=\"err\">{}</span>", esc(e)),
        };
        rows.push((
            c.started_at,
            0,
            format!(
                "<td>Pushary call</td><td><code>{}</code></td><td>{result} in {} ms</td>",
                esc(&c.call),
                c.duration_ms
            ),
        ));
    }
    for d in deliveries {
        let result = match (d.status_code, &d.error) {
            (Some(code), _) => format!("answered {code}"),
            (None, Some(e)) => esc(e),
            (None, None) => "no answer recorded".into(),
        };
        rows.push((
            d.started_at,
            0,
            format!(
                "<td>delivery attempt {}</td><td></td><td>{result}{}</td>",
                d.attempt,
                d.duration_ms.map(|ms| format!(" in {ms} ms")).unwrap_or_default()
            ),
        ));
    }
    // A call starts before the transition it causes is recorded.
    rows.sort_by_key(|(at, order, _)| (*at, *order));
    let mut out = String::from(
        "<table id=\"timeline\"><tr><th>Time</th><th>What</th><th>State</th><th>Detail</th></tr>",
    );
    for (at, _, cells) in rows {
        let _ = write!(out, "<tr><td>{}</td>{cells}</tr>", rfc3339(at));
    }
    out.push_str("</table>");
    out
}

/// Approvals finished per minute by outcome (stacked bars) and the inbox's
/// depth (line), over `minutes` minutes ending at `now`.
pub fn chart(activity: &Activity, now: i64, minutes: i64) -> String {
    const W: i64 = 720;
    const H: i64 = 160;
    let start = (now / 60_000 - minutes + 1) * 60_000;
    let slot = |t: i64| ((t - start) / 60_000).clamp(0, minutes - 1);
    let colors = [
        ("succeeded", "#2e9d4b"),
        ("denied", "#e0a100"),
        ("failed", "#c0392b"),
        ("uncertain", "#d35400"),
        ("expired", "#7f8c8d"),
    ];
    let mut per: Vec<[i64; 6]> = vec![[0; 6]; usize::try_from(minutes).unwrap_or(60)];
    for (minute, state, n) in &activity.finished {
        if *minute < start {
            continue;
        }
        let i = usize::try_from(slot(*minute)).unwrap_or(0);
        let k = colors.iter().position(|(s, _)| s == state).unwrap_or(colors.len());
        per[i][k] += n;
    }
    let mut depth = vec![0i64; per.len()];
    for (i, d) in depth.iter_mut().enumerate() {
        let end = start + (i64::try_from(i).unwrap_or(0) + 1) * 60_000;
        *d = activity
            .inbox
            .iter()
            .filter(|(received, processed)| *received < end && processed.is_none_or(|p| p >= end))
            .count() as i64;
    }
    let max_bar = per.iter().map(|c| c.iter().sum::<i64>()).max().unwrap_or(0).max(1);
    let max_depth = depth.iter().copied().max().unwrap_or(0).max(1);
    let bw = W / minutes;
    let mut svg = format!(
        "<svg id=\"chart\" width=\"{W}\" height=\"{}\" viewBox=\"0 0 {W} {}\" role=\"img\" \
         aria-label=\"approvals per minute by outcome and inbox depth, last {minutes} minutes\" \
         style=\"background:#fff;border:1px solid #e3e6ea\">",
        H + 20,
        H + 20
    );
    for (i, counts) in per.iter().enumerate() {
        let x = i64::try_from(i).unwrap_or(0) * bw;
        let mut y = H;
        for (k, n) in counts.iter().enumerate() {
            if *n == 0 {
                continue;
            }
            let h = (n * (H - 10) / max_bar).max(1);
            y -= h;
            let color = colors.get(k).map_or("#8e44ad", |c| c.1);
            let _ = write!(
                svg,
                "<rect x=\"{x}\" y=\"{y}\" width=\"{}\" height=\"{h}\" fill=\"{color}\"/>",
                bw - 1
            );
        }
    }
    let points: Vec<String> = depth
        .iter()
        .enumerate()
        .map(|(i, d)| {
            format!("{},{}", i64::try_from(i).unwrap_or(0) * bw + bw / 2, H - d * (H - 10) / max_depth)
        })
        .collect();
    let _ = write!(
        svg,
        "<polyline points=\"{}\" fill=\"none\" stroke=\"#2563eb\" stroke-width=\"2\"/>\
         <text x=\"4\" y=\"{}\" font-size=\"11\">−{minutes} min</text><text x=\"{}\" y=\"{}\" font-size=\"11\">now</text></svg>",
        points.join(" "),
        H + 15,
        W - 28,
        H + 15
    );
    let total: i64 = per.iter().flatten().sum();
    let mut legend = String::from("<p class=\"muted\">");
    for (s, c) in colors {
        let _ = write!(legend, "<span style=\"color:{c}\">■</span> {s} ");
    }
    let _ = write!(
        legend,
        "<span style=\"color:#8e44ad\">■</span> other · <span style=\"color:#2563eb\">—</span> inbox depth \
         (max {max_depth}) · {total} finished in the window, busiest minute {max_bar}</p>"
    );
    svg + &legend
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_links_and_query_values() {
        assert_eq!(enc("a b/&c"), "a+b%2F%26c");
    }

    #[test]
    fn the_chart_stacks_outcomes_and_draws_the_inbox_depth() {
        let now = 100 * 60_000 + 30_000;
        let activity = Activity {
            finished: vec![(99 * 60_000, "succeeded".into(), 4), (99 * 60_000, "failed".into(), 1)],
            inbox: vec![(98 * 60_000, None), (98 * 60_000, Some(99 * 60_000 + 1))],
        };
        let svg = chart(&activity, now, 5);
        assert_eq!(svg.matches("<rect").count(), 2, "{svg}");
        assert!(svg.contains("5 finished in the window, busiest minute 5"), "{svg}");
        assert!(svg.contains("(max 2)"), "{svg}");
    }

    #[test]
    fn the_timeline_shows_failed_pushary_calls_and_orders_by_time() {
        let call = |call: &str, at: i64, error: Option<&str>| PusharyCall {
            operation_id: "op".into(),
            call: call.into(),
            started_at: at,
            duration_ms: 3,
            status_code: error.map(|_| 503),
            error: error.map(str::to_string),
        };
        let calls = [
            call("create_decision", 10, Some("pushary answered 503: <busy>")),
            call("create_decision", 20, None),
        ];
        let html = timeline(&[], &[], &calls, &[]);
        let failed = html.find("pushary answered 503: &lt;busy&gt;").expect("the failure, escaped");
        let ok = html.find("ok in 3 ms").expect("the success");
        assert!(failed < ok, "{html}");
    }

    #[test]
    fn ages_read_like_a_person_would_say_them() {
        assert_eq!(age(10_000, 0), "10s");
        assert_eq!(age(3_600_000 + 120_000, 0), "1h 2m");
        assert_eq!(age(0, 5), "0s");
    }
}
